"""The accumulation contract in one process (ACCUMULATION.md §1, §3, §4, §5).

A run with micro-batch ``b`` and ``k`` accumulation steps must match the run
with one big batch ``b*k`` after every update, on a data set whose last window
is ragged and whose last micro-batch is short.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from finetune.accumulation_fusion import fuse_weight_grads
from finetune.attention_kernel import prefer_attention_kernel
from finetune.bias_apart import add_biases_apart
from finetune.config import ModelConfig, OptimConfig
from finetune.errors import ConfigError
from finetune.freezing import freeze_bottom
from finetune.lora import add_lora
from finetune.cpu import cpu_speedups, malloc_trim
from finetune.loop import TrainState, train_one_epoch
from finetune.noise_scale import squared_gradient_norm
from finetune.modeling import is_checkpointing, set_gradient_checkpointing, supports_checkpointing
from finetune.optimization import build_optimizer, build_scheduler, plan_updates
from finetune.accumulation import Batching, ShardLayout
from finetune.sampling import EpochSampler
from helpers import ARCHITECTURES, PADDING_READERS, REPO, chunk_collate, collate_for, chunked_texts, pad_collate, tiny_bert, tiny_model, token_dataset

# 76 samples: with b=8 that is 10 micro-batches (the last holds 4), so k=4 gives
# windows of 4, 4 and 2 micro-batches: a ragged last window and a short last micro-batch.
N = 76
B = 32


def _run(b: int, k: int, epochs: int = 2, lr: float = 1e-3, schedule: str = "linear", warmup: int = 1,
         max_grad_norm=None, data=None, mixed_precision="no", log_every: int = 1, sparse_embedding=True,
         heap="keep", checkpointing=False, dropout=0.0, dropout_masks=True, lora_rank=None, collate=pad_collate,
         model_type="bert", freeze_blocks=None, bias_apart=False, fusion=False, attention_kernel="auto",
         optimizer="adamw"):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=k, mixed_precision=mixed_precision)
    data = data if data is not None else token_dataset(N, seed=1)
    model = tiny_bert(seed=0, dropout=dropout) if model_type == "bert" else tiny_model(model_type, num_labels=2, dropout=dropout)
    if lora_rank is not None:  # adapters drawn from their own seed, alike in every run
        torch.manual_seed(3)
        model, _ = add_lora(model, ModelConfig(lora_rank=lora_rank, lora_dropout=dropout))
    if freeze_blocks is not None:  # the embeddings, and the lowest freeze_blocks blocks (before checkpointing, as setup)
        freeze_bottom(model, freeze_embeddings=True, freeze_blocks=freeze_blocks)
    prefer_attention_kernel(model, attention_kernel)  # on the outermost model, before checkpointing, as setup_run
    set_gradient_checkpointing(model, checkpointing)
    if bias_apart:
        assert add_biases_apart(model) > 0
    if fusion:  # after LoRA and the frozen blocks, as set_forward comes after them in setup_run
        assert fuse_weight_grads(model) > 0
    embedding_grads = []  # is each micro-batch's word-embedding gradient sparse?
    if model.get_input_embeddings().weight.requires_grad:
        model.get_input_embeddings().weight.register_hook(lambda g: embedding_grads.append(g.is_sparse))
    opt_cfg = OptimConfig(learning_rate=lr, lr_scheduler_type=schedule, warmup_steps=warmup, weight_decay=0.01,
                          optimizer=optimizer)
    optimizer = build_optimizer(model, opt_cfg)
    step_norms = []  # the norm of the gradient each optimizer step is handed, after clipping
    optimizer.register_step_pre_hook(lambda *_: step_norms.append(float(squared_gradient_norm(model)) ** 0.5))
    sampler = EpochSampler(len(data), seed=7, window_size=b * k)
    dl = DataLoader(data, batch_size=b, sampler=sampler, collate_fn=collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    plan = plan_updates(len(dl), k, epochs, None, warmup_steps=warmup)
    scheduler = build_scheduler(optimizer, opt_cfg, plan)
    snapshots = []
    scheduler_calls = {"n": 0}
    original_step = scheduler.step

    def counting_step(*a, **kw):
        scheduler_calls["n"] += 1
        return original_step(*a, **kw)

    scheduler.step = counting_step

    grads = []  # after each update: each parameter's gradient storage and whether it is all zero

    def on_update(state):
        params = list(acc.unwrap_model(model).named_parameters())
        snapshots.append({n: p.detach().clone() for n, p in params})
        grads.append({n: None if p.grad is None else (p.grad.data_ptr(), not p.grad.is_sparse and
                                                         bool((p.grad == 0).all())) for n, p in params})
        return False

    records = []
    state = TrainState()
    torch.manual_seed(11)  # dropout's stream starts here in every run
    with cpu_speedups(model, optimizer, acc, sparse_embedding=sparse_embedding, heap=heap,
                      dropout_masks=dropout_masks, own_attention=attention_kernel == "auto"):
        results = [train_one_epoch(model, optimizer, scheduler, dl, acc, epoch, state=state,
                                   max_grad_norm=max_grad_norm, log_every=log_every, on_log=records.append,
                                   on_update=on_update) for epoch in range(epochs)]
    return dict(snapshots=snapshots, records=records, state=state, plan=plan, scheduler=scheduler,
                scheduler_calls=scheduler_calls["n"], optimizer=optimizer, model=model, acc=acc, data=data,
                embedding_grads=embedding_grads, grads=grads, step_norms=step_norms, results=results)



def _assert_same_weights(a, b, rtol=1e-5, atol=1e-7, noise_only=None):
    """Every weight alike after every update; those whose names match ``noise_only`` to 1e-6 (see
    KEY_BIAS_NOISE)."""
    assert len(a) == len(b)
    for update, (sa, sb) in enumerate(zip(a, b)):
        for name in sa:
            noise = noise_only is not None and re.search(noise_only, name)
            torch.testing.assert_close(sa[name], sb[name], rtol=rtol, atol=1e-6 if noise else atol,
                                       msg=lambda m: f"update {update}, {name}: {m}")


# An attention key's bias has no gradient in exact arithmetic (softmax ignores a shift every key shares): rounding
# noise alone, which AdamW's epsilon turns into steps near 1e-7 that differ from one batching to the other
# (docs/accumulation.md). Pre-LayerNorm XLM-RoBERTa-XL's cross the tolerance (1.5e-7); the test checks that their
# gradient is noise, then holds them to 1e-6 and every other weight as every family's.
KEY_BIAS_NOISE = {"xlm-roberta-xl": r"attention\.self\.key\.bias$"}


def test_layout_counts_real_samples():
    layout = ShardLayout(num_samples=N, batch_size=8)
    assert layout.micro_batches_per_process == 10
    assert [layout.real_in_micro_batch(j) for j in range(10)] == [8] * 9 + [4]
    assert layout.windows(4) == [(0, 4), (4, 8), (8, 10)]
    assert [layout.real_in_window(a, b) for a, b in layout.windows(4)] == [32, 32, 12]
    # two processes, b=4: 19 global batches, the 20th is all repeats
    two = ShardLayout(num_samples=N, batch_size=4, num_processes=2, process_index=1)
    assert two.micro_batches_per_process == 10
    assert two.real_in_micro_batch(9, process_index=0) == 4
    assert two.real_in_micro_batch(9, process_index=1) == 0
    assert [two.real_in_window(a, b) for a, b in two.windows(4)] == [32, 32, 12]


@pytest.mark.parametrize("max_grad_norm", [None, 0.02])
def test_accumulated_windows_equal_big_batch_after_every_update(fresh_accelerate_state, max_grad_norm):
    big = _run(b=32, k=1, max_grad_norm=max_grad_norm)
    small = _run(b=8, k=4, max_grad_norm=max_grad_norm)
    # 3 updates per epoch (32, 32, 12 samples), 2 epochs
    assert len(big["snapshots"]) == len(small["snapshots"]) == 6
    _assert_same_weights(big["snapshots"], small["snapshots"])
    logged = [r["train/grad_norm"] for r in small["records"]]
    for rb, rs in zip(big["records"], small["records"]):
        assert rs["train/grad_norm"] == pytest.approx(rb["train/grad_norm"], rel=1e-5)
    if max_grad_norm:
        # the log says the norm before clipping, and every one was above the threshold; the optimizer was handed
        # the gradient clipped to it (AdamW all but ignores a gradient's scale, so equal weights cannot tell)
        assert all(norm > max_grad_norm for norm in logged)
        assert small["step_norms"] == pytest.approx([max_grad_norm] * len(logged), rel=1e-4)
    else:
        assert small["step_norms"] == pytest.approx(logged, rel=1e-5)


@pytest.mark.parametrize("model_type", [t for t in ARCHITECTURES if t != "bert"])
def test_every_supported_encoder_family_keeps_the_contract(fresh_accelerate_state, model_type):
    # Each family pads, positions and embeds in its own way (RoBERTa's positions count from its padding id,
    # DeBERTa's are relative, ModernBERT's attention is local in some layers, ALBERT and ELECTRA project
    # their embeddings): (8, 4) must still train the weights of (32, 1), with its word embedding's
    # gradient accumulated sparsely and the norm clipped.
    # The encoders that read the padding are padded to one length, as data.padding: auto pads them (the test below
    # shows why)
    collate = collate_for(model_type)
    big = _run(b=32, k=1, max_grad_norm=0.5, model_type=model_type, collate=collate)
    small = _run(b=8, k=4, max_grad_norm=0.5, model_type=model_type, collate=collate)
    assert len(small["embedding_grads"]) == 20 and all(small["embedding_grads"])
    noise = KEY_BIAS_NOISE.get(model_type)
    if noise is not None:  # what is held looser has no gradient but rounding's
        model = tiny_model(model_type, num_labels=2, dropout=0.0)
        batch = pad_collate(token_dataset(8, seed=2))
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        F.cross_entropy(out.logits, batch["labels"]).backward()
        grads = {name: p.grad.abs().max().item() for name, p in model.named_parameters()}
        noisy = [g for name, g in grads.items() if re.search(noise, name)]
        assert noisy and max(noisy) < 1e-9 < 1e-7 < min(g for name, g in grads.items() if "query.bias" in name)
    _assert_same_weights(big["snapshots"], small["snapshots"], noise_only=noise)
    moved = [name for name, weight in small["snapshots"][-1].items() if not torch.equal(weight, small["snapshots"][0][name])]
    assert any("embed" in name for name in moved) and any("classifier" in name or "head" in name for name in moved)


@pytest.mark.parametrize("model_type", PADDING_READERS)
def test_encoders_that_read_the_padding_keep_the_contract_padded_to_one_length_only(fresh_accelerate_state,
                                                                                     model_type):
    # Their output for a text depends on how far its batch is padded (finetune.truncation.READS_THE_PADDING): padded
    # to each micro-batch's longest text, (8, 4) and (32, 1) pad a text differently and train other weights; padded
    # to one length, as data.padding: auto pads them, the same (BigBird too, which is not among the families above)
    one_length = collate_for(model_type)
    _assert_same_weights(*[_run(b=b, k=k, max_grad_norm=0.5, model_type=model_type, collate=one_length)["snapshots"]
                           for b, k in ((32, 1), (8, 4))])
    apart = [_run(b=b, k=k, max_grad_norm=0.5, model_type=model_type)["snapshots"] for b, k in ((32, 1), (8, 4))]
    with pytest.raises(AssertionError):
        _assert_same_weights(*apart)


@pytest.mark.parametrize("max_grad_norm", [None, 0.02])
def test_sparse_and_dense_embedding_gradients_both_keep_the_contract(fresh_accelerate_state, max_grad_norm):
    """The default accumulates the word-embedding rows sparsely and makes them dense once per update."""
    big = _run(b=32, k=1, max_grad_norm=max_grad_norm, sparse_embedding=False)
    sparse = _run(b=8, k=4, max_grad_norm=max_grad_norm)
    dense = _run(b=8, k=4, max_grad_norm=max_grad_norm, sparse_embedding=False)
    # each path really ran: 10 micro-batches per epoch, 2 epochs
    assert sparse["embedding_grads"] == [True] * 20 and dense["embedding_grads"] == [False] * 20
    assert big["embedding_grads"] == [False] * 6
    _assert_same_weights(big["snapshots"], sparse["snapshots"])
    _assert_same_weights(big["snapshots"], dense["snapshots"])
    name = "bert.embeddings.word_embeddings.weight"
    assert not torch.equal(sparse["snapshots"][0][name], sparse["snapshots"][-1][name])  # the embedding learned
    # the model is handed back as it came: a loop of the caller's own gets dense gradients
    assert sparse["model"].get_input_embeddings().sparse is False


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_gradient_checkpointing_keeps_the_contract(fresh_accelerate_state, max_grad_norm):
    # (8, 4) recomputing its activations trains the weights of (32, 1) that keeps them, ragged windows included
    big = _run(b=32, k=1, max_grad_norm=max_grad_norm)
    recomputed = _run(b=8, k=4, max_grad_norm=max_grad_norm, checkpointing=True)
    assert is_checkpointing(recomputed["model"]) and not is_checkpointing(big["model"])
    _assert_same_weights(big["snapshots"], recomputed["snapshots"])


@pytest.mark.parametrize("dropout_masks", [True, False])
def test_recomputation_replays_the_dropout_masks(fresh_accelerate_state, dropout_masks):
    # Dropout on: the recomputed forward must draw the masks the first forward drew, with the CPU's 16-bit
    # masks and the embedding's row gradient on or off. (Against (32, 1) the masks differ whatever
    # checkpointing does: 32 rows draw their masks in another order than four micro-batches of 8.)
    kept = _run(b=8, k=4, dropout=0.1, dropout_masks=dropout_masks)
    recomputed = _run(b=8, k=4, dropout=0.1, dropout_masks=dropout_masks, checkpointing=True)
    assert len(kept["snapshots"]) == 6
    for update, (a, b) in enumerate(zip(kept["snapshots"], recomputed["snapshots"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"update {update}, {name}"
    # and dropout was on: without it the weights differ
    plain = _run(b=8, k=4, checkpointing=True)
    last, dropped = plain["snapshots"][-1], kept["snapshots"][-1]
    assert not all(torch.equal(last[name], dropped[name]) for name in last)


@pytest.mark.parametrize("model_type", [t for t in ARCHITECTURES if t != "bert"])
def test_every_family_that_recomputes_replays_its_dropout_masks(fresh_accelerate_state, model_type):
    # Each family drops out in its own places (DeBERTa's own attention, ModernBERT's embedding and MLP dropout,
    # DistilBERT's head); the CPU's 16-bit masks must replay in all of them. A family whose transformers
    # model cannot recompute (ALBERT, MPNet; MobileBERT before transformers 5) is refused in one line
    # before anything trains.
    model_class = type(tiny_model(model_type, num_labels=2)).__name__
    if not supports_checkpointing(tiny_model(model_type, num_labels=2)):
        for lora_rank in (None, 4):  # the model named, not PEFT's wrapper
            with pytest.raises(ConfigError, match=f"gradient_checkpointing: {model_class} does not support it"):
                _run(b=8, k=4, model_type=model_type, checkpointing=True, lora_rank=lora_rank)
        assert model_type in ("albert", "mpnet", "mobilebert")
        return
    kept = _run(b=8, k=4, dropout=0.1, model_type=model_type)
    recomputed = _run(b=8, k=4, dropout=0.1, model_type=model_type, checkpointing=True)
    assert is_checkpointing(recomputed["model"])
    for update, (a, b) in enumerate(zip(kept["snapshots"], recomputed["snapshots"])):
        for name in a:
            assert torch.equal(a[name], b[name]), f"update {update}, {name}"
    plain = _run(b=8, k=4, model_type=model_type, checkpointing=True)
    last, dropped = plain["snapshots"][-1], kept["snapshots"][-1]
    assert not all(torch.equal(last[name], dropped[name]) for name in last)


@pytest.mark.parametrize("lora_rank", [None, 4])
def test_biases_added_apart_keep_the_contract_and_the_fused_weights(fresh_accelerate_state, lora_rank):
    """training.bias_apart: (8, 4) trains (32, 1)'s weights after every update, and in fp32 both are the runs of
    the linear layers' fused addmm, to float rounding (the same sums in another order)."""
    big = _run(b=32, k=1, max_grad_norm=1.0, lora_rank=lora_rank, bias_apart=True)
    small = _run(b=8, k=4, max_grad_norm=1.0, lora_rank=lora_rank, bias_apart=True)
    _assert_same_weights(big["snapshots"], small["snapshots"])
    fused = _run(b=8, k=4, max_grad_norm=1.0, lora_rank=lora_rank)
    _assert_same_weights(fused["snapshots"], small["snapshots"])
    assert any(type(m).__name__ == "BiasApartLinear" for m in small["model"].modules())
    assert not any(type(m).__name__ == "BiasApartLinear" for m in fused["model"].modules())


@pytest.mark.parametrize("lora_rank, checkpointing, freeze_blocks", [(None, False, None), (4, False, None),
                                                                    (None, True, 1)])
def test_fused_gradient_accumulation_keeps_the_contract_and_the_gradients_in_place(fresh_accelerate_state, lora_rank,
                                                                                   checkpointing, freeze_blocks):
    """training.gradient_accumulation_fusion: (8, 4) trains (32, 1)'s weights after every update, and in fp32 both
    are autograd's runs, to float rounding; with LoRA's adapters, and with the lower block frozen and the rest
    recomputed. The gradients are zeroed in place at every update, in the storage they had after the first,
    at k = 1 too, where autograd's are freed."""
    settings = dict(max_grad_norm=1.0, lora_rank=lora_rank, checkpointing=checkpointing, freeze_blocks=freeze_blocks)
    big = _run(b=32, k=1, fusion=True, **settings)
    small = _run(b=8, k=4, fusion=True, **settings)
    _assert_same_weights(big["snapshots"], small["snapshots"])
    plain = _run(b=8, k=4, **settings)
    _assert_same_weights(plain["snapshots"], small["snapshots"])
    assert any(type(m).__name__ == "FusedAccumulationLinear" for m in small["model"].modules())
    for run in (big, small):
        trained = {name for name, g in run["grads"][0].items() if g is not None}
        assert any("classifier" in name for name in trained)
        assert all(update == run["grads"][0] for update in run["grads"][1:])
        assert all(g[1] for g in run["grads"][0].values() if g is not None)  # zero after each update
    assert all(g is None for update in _run(b=32, k=1, **settings)["grads"] for g in update.values())


@pytest.mark.parametrize("lora_rank, checkpointing", [(None, False), (4, True)])
def test_an_attention_kernel_asked_for_keeps_the_contract(fresh_accelerate_state, lora_rank, checkpointing):
    """training.attention_kernel: math (torch's choice on a CPU is flash) trains (32, 1)'s weights with (8, 4)
    after every update, with LoRA's adapters and recomputed blocks too; and the weights of torch's choice, to
    float rounding (the same attention)."""
    settings = dict(max_grad_norm=1.0, lora_rank=lora_rank, checkpointing=checkpointing)
    big = _run(b=32, k=1, attention_kernel="math", **settings)
    small = _run(b=8, k=4, attention_kernel="math", **settings)
    _assert_same_weights(big["snapshots"], small["snapshots"])
    _assert_same_weights(_run(b=8, k=4, **settings)["snapshots"], small["snapshots"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_keeps_the_contract(fresh_accelerate_state, checkpointing):
    # LoRA's adapters and the head trained by (8, 4), recomputing or not, are (32, 1)'s after every update
    big = _run(b=32, k=1, max_grad_norm=1.0, lora_rank=4)
    small = _run(b=8, k=4, max_grad_norm=1.0, lora_rank=4, checkpointing=checkpointing)
    assert is_checkpointing(small["model"]) == checkpointing
    _assert_same_weights(big["snapshots"], small["snapshots"])
    # what trains is the adapters and the head; the encoder's own weights never move
    first, last = small["snapshots"][0], small["snapshots"][-1]
    trained = {n for n, p in small["model"].named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or ".modules_to_save." in n for n in trained)
    frozen = tiny_bert(seed=0).state_dict()
    for name, value in last.items():
        if name in trained:
            assert not torch.equal(value, first[name]) or "lora_A" in name, name  # B and the head move at once
        elif ".original_module." not in name and ".lora_" not in name:
            assert torch.equal(value, frozen[name.removeprefix("base_model.model.").replace(".base_layer", "")]), name


@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_the_8bit_adamw_keeps_the_contract(fresh_accelerate_state, monkeypatch, max_grad_norm):
    """The 8-bit AdamW is handed the big batch's gradient, as torch's is. Its moments are quantized: where float
    rounding of the summation order moves a moment across a quantization level, that weight's update differs
    by the level's step, so the weights agree to 2e-5 (the largest gap measured is 6e-6, with clipping), where
    the updates move them by 3e-3 and the 8-bit moments take them 2e-3 from torch's AdamW."""
    import finetune.optimizer_state

    # the tiny model's matrices are under bitsandbytes' 4,096 elements: kept in 8 bits, as a full-sized model's
    monkeypatch.setattr(finetune.optimizer_state, "MIN_8BIT_SIZE", 256)
    big = _run(b=32, k=1, max_grad_norm=max_grad_norm, optimizer="adamw_8bit")
    small = _run(b=8, k=4, max_grad_norm=max_grad_norm, optimizer="adamw_8bit")
    _assert_same_weights(big["snapshots"], small["snapshots"], rtol=1e-5, atol=2e-5)
    for rb, rs in zip(big["records"], small["records"]):
        assert rs["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-6)
    states = small["optimizer"].optimizer.state.values()
    assert torch.uint8 in {state["state1"].dtype for state in states}
    torch_adamw = _run(b=32, k=1, max_grad_norm=max_grad_norm)["snapshots"][-1]
    assert max((torch_adamw[n] - w).abs().max().item() for n, w in big["snapshots"][-1].items()) > 1e-3


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_chunked_texts_keep_the_contract_text_by_text(fresh_accelerate_state, max_grad_norm):
    """Texts of 1 to 5 windows: (8, 4) trains (32, 1)'s weights after every update, ragged last window included."""
    from finetune.chunks import CHUNK_ROWS

    data, collate = chunked_texts(N), chunk_collate
    big = _run(b=32, k=1, max_grad_norm=max_grad_norm, data=data, collate=collate)
    small = _run(b=8, k=4, max_grad_norm=max_grad_norm, data=data, collate=collate)
    assert len(big["snapshots"]) == len(small["snapshots"]) == 6  # windows of 32, 32 and 12 texts, 2 epochs
    _assert_same_weights(big["snapshots"], small["snapshots"])
    # a micro-batch holds whole texts: each text's windows are rows of the micro-batch its index is in
    batch = collate(data[:8])
    assert batch["input_ids"].shape[0] == sum(len(text["input_ids"]) for text in data[:8]) == 1 + 2 + 3 + 4 + 5 + 1 + 2 + 3
    assert batch[CHUNK_ROWS][2].tolist() == [3, 4, 5, -1, -1] and batch["labels"].shape == (8,)


def test_each_text_weighs_the_same_in_an_update_whatever_its_windows(fresh_accelerate_state):
    """The first update's loss is the mean over texts of the loss of the mean of each text's windows' logits."""
    # the label goes with the number of windows, so weighing windows instead of texts would show in the loss
    data = [{**text, "labels": int(len(text["input_ids"]) >= 3)} for text in chunked_texts(N)]
    run = _run(b=8, k=4, data=data, collate=chunk_collate)  # its first record: the loss before the first update
    model = tiny_bert(seed=0).eval()
    order = EpochSampler(len(data), seed=7, window_size=32).order()[:32]
    per_text, per_window = [], []
    with torch.no_grad():
        for i in order:
            rows = pad_collate([{"input_ids": w, "labels": 0} for w in data[i]["input_ids"]])
            logits = model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"]).logits
            label = torch.tensor([data[i]["labels"]])
            per_text.append(F.cross_entropy(logits.mean(0, keepdim=True), label))
            per_window += list(F.cross_entropy(logits, label.expand(len(logits)), reduction="none"))
    expected = torch.stack(per_text).double().mean().item()
    assert run["records"][0]["train/loss"] == pytest.approx(expected, rel=1e-5)
    # what it would be if each window were a sample: texts of many windows would weigh more
    assert torch.stack(per_window).double().mean().item() != pytest.approx(expected, rel=1e-2)
    assert run["records"][0]["train/samples"] == 32  # texts, not windows


@pytest.mark.parametrize("freeze_blocks, checkpointing", [(0, False), (1, False), (1, True)])
def test_a_frozen_bottom_keeps_the_contract_for_what_trains(fresh_accelerate_state, freeze_blocks, checkpointing):
    # the clipped norm is the trained weights' alone in both runs; the frozen ones never move
    big = _run(b=32, k=1, max_grad_norm=0.5, freeze_blocks=freeze_blocks)
    small = _run(b=8, k=4, max_grad_norm=0.5, freeze_blocks=freeze_blocks, checkpointing=checkpointing)
    _assert_same_weights(big["snapshots"], small["snapshots"])
    first, last = small["snapshots"][0], small["snapshots"][-1]
    frozen = [n for n in last if "embeddings" in n or (freeze_blocks and ".layer.0." in n)]
    assert frozen and all(torch.equal(first[n], last[n]) for n in frozen)
    assert small["embedding_grads"] == []  # the word embedding has no gradient at all
    assert not torch.equal(first["bert.encoder.layer.1.output.dense.weight"],
                           last["bert.encoder.layer.1.output.dense.weight"])


def test_gradient_buffers_are_kept_between_updates_only_when_accumulating(fresh_accelerate_state):
    accumulated = _run(b=8, k=4)["grads"]
    # k > 1: every gradient is zeroed in place after an update, in the same storage as after the first
    first = accumulated[0]
    assert all(g is not None and g[1] for g in first.values())
    for update in accumulated[1:]:
        assert update == first
    # k = 1: freed, so the next forward pass does not hold them
    assert all(g is None for update in _run(b=32, k=1)["grads"] for g in update.values())


def test_cpu_heap_trim_trims_after_every_update_inside_the_switch_only(fresh_accelerate_state, monkeypatch):
    import finetune.cpu

    trims = []
    monkeypatch.setattr(finetune.cpu, "malloc_trim", lambda: lambda pad: trims.append(pad))
    run = _run(b=8, k=4, heap="trim")
    assert trims == [0] * 6  # one per update: 3 updates per epoch, 2 epochs
    run["optimizer"].step()  # outside cpu_speedups: the hook is gone
    assert trims == [0] * 6


def test_cpu_heap_keep_never_trims(fresh_accelerate_state, monkeypatch):
    import finetune.cpu

    trims = []
    monkeypatch.setattr(finetune.cpu, "malloc_trim", lambda: lambda pad: trims.append(pad))
    run = _run(b=8, k=4)
    assert len(run["snapshots"]) == 6 and trims == []


def test_cpu_heap_trim_without_glibc_switches_nothing(fresh_accelerate_state, monkeypatch):
    from accelerate import Accelerator

    import finetune.cpu
    from finetune.cpu import plan_cpu_speedups

    acc = Accelerator(cpu=True)
    assert plan_cpu_speedups(tiny_bert(seed=0), acc, heap="trim").describe().endswith("heap=trim")
    monkeypatch.setattr(finetune.cpu, "malloc_trim", lambda: None)
    plan = plan_cpu_speedups(tiny_bert(seed=0), acc, heap="trim")
    assert not plan.trim_heap and "heap=" not in plan.describe()


def test_cpu_heap_release_sets_glibcs_threshold_once_when_training_starts(fresh_accelerate_state, monkeypatch):
    from accelerate import Accelerator

    import finetune.cpu
    from finetune.cpu import M_MMAP_THRESHOLD, plan_cpu_speedups

    calls = []
    monkeypatch.setattr(finetune.cpu, "mallopt", lambda: lambda option, value: calls.append((option, value)) or 1)
    assert plan_cpu_speedups(tiny_bert(seed=0), Accelerator(cpu=True), heap="release").describe().endswith(
        "heap=release")
    assert calls == []  # planning (the start line) changes nothing
    _run(b=8, k=4, heap="release")
    assert calls == [(M_MMAP_THRESHOLD, 1 << 20)]
    monkeypatch.setattr(finetune.cpu, "mallopt", lambda: None)  # no glibc: nothing to switch, nothing said
    assert "heap=" not in plan_cpu_speedups(tiny_bert(seed=0), Accelerator(cpu=True), heap="release").describe()


_FREE_LARGE_BLOCKS = """
import ctypes, json, os, sys, torch
from finetune.cpu import release_large_blocks
libc = ctypes.CDLL("libc.so.6")
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Mallinfo2
def mapped():  # bytes in blocks glibc mapped on their own, outside the heap
    return libc.mallinfo2().hblkhd
def resident():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
if sys.argv[1] == "release":
    release_large_blocks()
# The same start whatever the imports left: the heap's free top handed back, so that the next large block cannot
# come from it, then one 24 MiB block made and freed. Mapped on its own (below glibc's 32 MiB ceiling), its free
# raises glibc's adaptive threshold above it, as a forward pass's freed activations do in training.
libc.malloc_trim(0)
outside = mapped()
raiser = torch.ones(24 << 20, dtype=torch.uint8)
raiser_mapped = mapped() - outside >= 24 << 20
del raiser
outside = mapped()
# 4 MiB activations, every other one freed while its neighbours live on, as a forward pass frees some of its
# tensors and keeps others: each freed block lies between live ones, whatever the heap held before (tensors of
# another size could take older holes and leave the freed blocks side by side, to be trimmed together)
blocks = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(100)]
large_mapped = (mapped() - outside) / (400 << 20)
before = resident()
del blocks[0::2]
print(json.dumps({"raiser_mapped": raiser_mapped, "large_mapped": large_mapped,
                  "handed_back": (before - resident()) / (200 << 20)}))
"""


def _free_large_blocks(heap: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _FREE_LARGE_BLOCKS, heap], capture_output=True, text=True, cwd=REPO,
                          check=True)
    return json.loads(proc.stdout)


def test_cpu_heap_release_hands_freed_large_tensors_back_where_keep_holds_them():
    if malloc_trim() is None:
        pytest.skip("glibc's allocator only")
    keep, release = _free_large_blocks("keep"), _free_large_blocks("release")
    # glibc's default, once a large block has been freed: 4 MiB tensors come from the heap, and freed, stay there
    assert keep["raiser_mapped"] and keep["large_mapped"] < 0.05 and keep["handed_back"] < 0.05, keep
    # release: each one mapped on its own, whatever the threshold had risen to, and handed back when freed
    assert release["large_mapped"] > 0.99 and release["handed_back"] > 0.95, release


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_unknown_cpu_heap_setting_is_refused_on_every_device(device):
    from types import SimpleNamespace

    from finetune.cpu import plan_cpu_speedups

    accelerator = SimpleNamespace(device=torch.device(device), num_processes=1, scaler=None)
    with pytest.raises(ValueError, match="heap must be one of 'keep', 'trim', 'release', got 'trimm'"):
        plan_cpu_speedups(tiny_bert(seed=0), accelerator, heap="trimm")


def test_textbook_loss_over_k_differs_on_ragged_window(fresh_accelerate_state):
    """The comparison above is sensitive: the textbook recipe (mean loss / k) fails it."""
    from accelerate import Accelerator

    data = token_dataset(N, seed=1)
    big = _run(b=32, k=1, epochs=1)

    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = tiny_bert(seed=0)
    opt_cfg = OptimConfig(learning_rate=1e-3, warmup_steps=1, weight_decay=0.01)
    optimizer = build_optimizer(model, opt_cfg)
    dl = DataLoader(data, batch_size=8, sampler=EpochSampler(N, seed=7, window_size=32), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    scheduler = build_scheduler(optimizer, opt_cfg, plan_updates(len(dl), 4, 1, None, warmup_steps=1))
    dl.sampler.set_epoch(0) if hasattr(dl.sampler, "set_epoch") else None
    dl.batch_sampler.sampler.set_epoch(0)
    snaps = []
    for batch in dl:
        with acc.accumulate(model):
            labels = batch.pop("labels")
            loss = F.cross_entropy(model(**batch).logits, labels)
            acc.backward(loss)
            if acc.sync_gradients:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                snaps.append({n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()})
    assert len(snaps) == 3
    _assert_same_weights(big["snapshots"][:2], snaps[:2], rtol=1e-4, atol=1e-6)  # full windows agree
    with pytest.raises(AssertionError):
        _assert_same_weights(big["snapshots"][2:3], snaps[2:3])  # the ragged one does not


def test_scheduler_counts_updates(fresh_accelerate_state):
    run = _run(b=8, k=4, epochs=2, warmup=2)
    plan = run["plan"]
    assert plan.updates_per_epoch == 3 and plan.total_updates == 6
    assert run["state"].step == 6
    # stepped once per update, never per micro-batch
    assert run["scheduler_calls"] == 6
    # update j used schedule(j): linear warmup over 2 updates, then linear decay to 0 at update 6
    expected = [1e-3 * (j / 2 if j < 2 else (6 - j) / (6 - 2)) for j in range(6)]
    logged = [r["train/lr"] for r in run["records"]]
    assert logged == pytest.approx(expected, rel=1e-9, abs=1e-15)
    # after the last update the schedule sits at its end value, and got there no earlier
    assert run["optimizer"].param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-15)
    assert logged[0] == 0.0  # transformers' warmup starts from 0 at update 0
    assert min(logged[1:]) > 0  # ...and the decay reaches 0 only after the last update


def test_logged_loss_is_the_big_batch_loss(fresh_accelerate_state):
    big = _run(b=32, k=1, epochs=1, lr=1e-3)
    small = _run(b=8, k=4, epochs=1, lr=1e-3)
    assert [r["step"] for r in small["records"]] == [1, 2, 3]
    for rb, rs in zip(big["records"], small["records"]):
        assert rs["train/loss"] == pytest.approx(rb["train/loss"], rel=1e-5)
    # the epoch's own loss, which a notebook prints, is the mean over its samples: its updates' losses weighed by
    # their windows' 32, 32 and 12 samples, the big batch's too
    (result,) = small["results"]
    assert result.updates == 3 and result.samples == N
    weighed = sum(r["train/loss"] * n for r, n in zip(small["records"], (32, 32, 12))) / N
    assert result.loss == pytest.approx(weighed, rel=1e-9)
    assert result.loss == pytest.approx(big["results"][0].loss, rel=1e-5)
    # and it is the mean per-sample loss of the first window under the initial weights
    data = small["data"]
    order = EpochSampler(N, seed=7, window_size=32).order()
    model = tiny_bert(seed=0).eval()
    with torch.no_grad():
        window = pad_collate([data[i] for i in order[:32]])
        labels = window.pop("labels")
        expected = F.cross_entropy(model(**window).logits, labels).item()
    assert small["records"][0]["train/loss"] == pytest.approx(expected, rel=1e-5)
    # samples and tokens are counted once: every sample of the epoch, no more
    assert small["records"][-1]["train/samples"] == N
    tokens = sum(len(x["input_ids"]) for x in data)
    assert small["records"][-1]["train/tokens"] == tokens


def test_log_every_averages_over_updates(fresh_accelerate_state):

    every = _run(b=8, k=4, epochs=2)["records"]
    records = _run(b=8, k=4, epochs=2, log_every=2)["records"]
    # 3 updates per epoch, log_every=2: records at updates 2, 3 (epoch end), 5, 6
    assert [r["step"] for r in records] == [2, 3, 5, 6]
    # the record of updates 1-2 is the sample-weighted mean of their losses (32 samples each)
    assert records[0]["train/loss"] == pytest.approx((every[0]["train/loss"] + every[1]["train/loss"]) / 2, rel=1e-6)
    assert records[0]["train/lr"] == pytest.approx((every[0]["train/lr"] + every[1]["train/lr"]) / 2, rel=1e-9)
    assert records[0]["train/grad_norm"] == pytest.approx(
        (every[0]["train/grad_norm"] + every[1]["train/grad_norm"]) / 2, rel=1e-6)
    # throughput over the record's own updates: its samples and tokens over the same seconds
    before = {"train/samples": 0, "train/tokens": 0}
    for record in records:
        samples, tokens = (record[key] - before[key] for key in ("train/samples", "train/tokens"))
        assert record["train/samples_per_s"] / record["train/tokens_per_s"] == pytest.approx(samples / tokens)
        before = record


def test_first_update_after_exactly_k_micro_batches(fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    data = token_dataset(N, seed=1)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    dl = DataLoader(data, batch_size=8, sampler=EpochSampler(N, seed=7), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    seen = {"batches": 0}
    forward = model.forward

    def counting_forward(*a, **kw):
        seen["batches"] += 1
        return forward(*a, **kw)

    model.forward = counting_forward
    at_update = []
    train_one_epoch(model, optimizer, None, dl, acc, 0,
                    on_update=lambda s: at_update.append(seen["batches"]) and False)
    assert at_update == [4, 8, 10]


def test_same_seed_same_weights(fresh_accelerate_state):
    a = _run(b=8, k=4, epochs=1)
    b = _run(b=8, k=4, epochs=1)
    for name, tensor in a["snapshots"][-1].items():
        assert torch.equal(tensor, b["snapshots"][-1][name])


def test_length_grouped_order_pads_less_and_stays_random():
    lengths = [int(x) for x in torch.randint(1, 100, (203,), generator=torch.Generator().manual_seed(0))]
    s1 = EpochSampler(203, seed=3, lengths=lengths, group_by_length=True, window_size=32, group_windows=4)
    order = s1.order()
    assert sorted(order) == list(range(203))

    def padding(o):  # padded positions in micro-batches of 8
        return sum(len(mb) * max(lengths[i] for i in mb) - sum(lengths[i] for i in mb)
                   for mb in (o[i : i + 8] for i in range(0, len(o), 8)))

    assert padding(order) < padding(EpochSampler(203, seed=3).order()) / 3
    windows = [order[i : i + 32] for i in range(0, 203, 32)]
    # a new epoch gives a new order; the same epoch the same order
    s1.set_epoch(1)
    assert s1.order() != order
    s1.set_epoch(0)
    assert s1.order() == order
    # the short window stays last
    assert len(windows[-1]) == 203 % 32


def test_default_length_grouping_sorts_within_windows_whose_samples_stay_random():
    """Each update's sample set is the ungrouped order's window; only the order inside it is by length."""
    lengths = [int(x) for x in torch.randint(1, 100, (203,), generator=torch.Generator().manual_seed(0))]
    grouped = EpochSampler(203, seed=3, lengths=lengths, group_by_length=True, window_size=32)
    plain = EpochSampler(203, seed=3, window_size=32)
    for epoch in (0, 1):
        grouped.set_epoch(epoch)
        plain.set_epoch(epoch)
        order, random_order = grouped.order(), plain.order()
        for start in range(0, 203, 32):
            window = order[start : start + 32]
            assert set(window) == set(random_order[start : start + 32]), (epoch, start)
            assert [lengths[i] for i in window] == sorted((lengths[i] for i in window), reverse=True)


def test_runner_passes_length_group_windows_to_the_sampler(tmp_path):
    """``data.length_group_windows`` reaches the order: 16 windows per sorted mega-batch, 1 by default."""
    from finetune.config import config_from_dict
    from finetune.dataloaders import training_sampler

    lengths = [int(x) for x in torch.randint(1, 100, (600,), generator=torch.Generator().manual_seed(1))]

    def sampler(**data):
        cfg = config_from_dict({"data": {"train_file": "t.csv", **data}, "training": {"seed": 3}})
        return training_sampler(cfg, lengths, Batching(8, 4, 1))

    assert sampler().group_windows == 1
    wide = sampler(length_group_windows=16)
    expected = EpochSampler(600, seed=3, lengths=lengths, group_by_length=True, window_size=32, group_windows=16)
    assert wide.order() == expected.order() != sampler().order()


def test_plan_updates_sizes_in_updates():
    plan = plan_updates(10, 4, 3, None, warmup_ratio=0.1)
    assert (plan.updates_per_epoch, plan.total_updates, plan.num_epochs, plan.warmup_updates) == (3, 9, 3, 1)
    plan = plan_updates(10, 4, None, 7)
    assert (plan.total_updates, plan.num_epochs) == (7, 3)
    plan = plan_updates(10, 1, 1.5, None)
    assert (plan.total_updates, plan.num_epochs) == (15, 2)
    assert math.ceil(10 / 4) == plan_updates(10, 4, 1, None).total_updates


def test_adamw_groups_skip_decay_on_biases_and_layernorm():
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    plain = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.0 for p in g["params"]}
    assert decayed | plain == set(names.values()) and not decayed & plain
    assert all(n.endswith("bias") or "LayerNorm" in n for n in plain)
    assert "bert.encoder.layer.0.attention.output.LayerNorm.weight" in plain
    assert "classifier.weight" in decayed and "bert.embeddings.word_embeddings.weight" in decayed


@pytest.mark.parametrize("prepared", [True, False])
def test_epoch_reaches_the_sampler(fresh_accelerate_state, prepared):
    """Each epoch draws its own order: the sampler sees the epoch, prepared by Accelerate or not."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    data = token_dataset(16, seed=1)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    sampler = EpochSampler(len(data), seed=7)
    dl = DataLoader(data, batch_size=8, sampler=sampler, collate_fn=pad_collate)
    if prepared:
        model, optimizer, dl = acc.prepare(model, optimizer, dl)
    train_one_epoch(model, optimizer, None, dl, acc, 3, state=TrainState())
    assert sampler.epoch == 3


@pytest.mark.parametrize("prepared", [True, False])
@pytest.mark.parametrize("skipping_starts_at_iteration_0", [False, True])
def test_a_resume_mid_epoch_takes_up_that_epochs_order_where_it_stopped(fresh_accelerate_state, monkeypatch, prepared,
                                                                         skipping_starts_at_iteration_0):
    """A call resuming epoch 3 at micro-batch 2 trains the epoch's micro-batches from the third on, as the
    uninterrupted epoch did. Accelerate before 1.15 starts the loader that skips the first micro-batches at
    iteration 0, which it hands the sampler as the epoch when it iterates (the case emulated here): the epoch's
    order must still be epoch 3's."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    data = token_dataset(16, seed=1)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    dl = DataLoader(data, batch_size=4, sampler=EpochSampler(len(data), seed=7), collate_fn=pad_collate)
    if prepared:
        model, optimizer, dl = acc.prepare(model, optimizer, dl)
    if skipping_starts_at_iteration_0:
        skip = acc.skip_first_batches

        def skip_from_iteration_0(loader, num_batches=0):
            skipping = skip(loader, num_batches)
            if hasattr(skipping, "iteration"):
                skipping.iteration = 0
            return skipping

        monkeypatch.setattr(acc, "skip_first_batches", skip_from_iteration_0)
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].tolist()),
                                    with_kwargs=True)
    train_one_epoch(model, optimizer, None, dl, acc, 3, state=TrainState(epoch=3))
    whole, seen[:] = list(seen), []
    train_one_epoch(model, optimizer, None, dl, acc, 3, state=TrainState(epoch=3, micro_batch=2))
    assert len(whole) == 4 and seen == whole[2:]


def test_records_count_updates_across_epochs_with_one_state_and_say_so_without(fresh_accelerate_state):
    import warnings

    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    data = token_dataset(16, seed=1)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    dl = DataLoader(data, batch_size=4, sampler=EpochSampler(len(data), seed=7), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    steps, state = [], TrainState()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one state across epochs: nothing to warn of
        for epoch in range(2):
            train_one_epoch(model, optimizer, None, dl, acc, epoch, state=state,
                            on_log=lambda record: steps.append((record["step"], record["train/samples"])))
    assert steps == [(1, 8), (2, 16), (3, 24), (4, 32)]
    steps.clear()
    train_one_epoch(model, optimizer, None, dl, acc, 0, on_log=lambda record: steps.append(record["step"]))
    with pytest.warns(UserWarning, match=r"train_one_epoch: epoch 1 without state=, so its records count updates "
                                         r"\(and samples\) from 1 again; pass one TrainState\(\) to every epoch"):
        train_one_epoch(model, optimizer, None, dl, acc, 1, on_log=lambda record: steps.append(record["step"]))
    assert steps == [1, 2, 1, 2]


def test_a_call_after_the_last_update_trains_nothing_and_says_so(fresh_accelerate_state):
    # a notebook's training cell run again: one more update would step the schedule past its end
    from accelerate import Accelerator
    from transformers import get_constant_schedule

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    data = token_dataset(16, seed=1)
    model = tiny_bert(seed=0)
    optimizer = build_optimizer(model, OptimConfig(learning_rate=1e-3))
    scheduler = get_constant_schedule(optimizer)
    dl = DataLoader(data, batch_size=4, sampler=EpochSampler(len(data), seed=7), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    state = TrainState()
    assert train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, max_updates=2).updates == 2
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(UserWarning, match=r"train_one_epoch: epoch 0: the 2 updates planned are done \(state.step\), "
                                         r"so nothing was trained; setup_run builds the run again"):
        again = train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, max_updates=2)
    assert (again.updates, again.samples, state.step, state.epoch, scheduler.last_epoch) == (0, 0, 2, 1, 2)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_dropout_draws_fresh_masks_on_every_micro_batch(fresh_accelerate_state):
    """Dropout stays on while accumulating, at its rate, with a new mask per micro-batch (none replayed)."""
    from accelerate import Accelerator

    model = tiny_bert(dropout=0.5)
    masks = []
    layer = model.bert.encoder.layer[0].output.dropout

    def record(module, inputs, output):
        dropped = (output == 0) & (inputs[0] != 0)
        masks.append(dropped[:, :2].flatten().clone())  # the first two positions exist in every row

    layer.register_forward_hook(record)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    dl = DataLoader(token_dataset(32), batch_size=4, collate_fn=pad_collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)
    train_one_epoch(model, optimizer, None, dl, accelerator, epoch=0)
    assert len(masks) == 8
    assert len({tuple(m.tolist()) for m in masks}) == 8
    rate = torch.cat(masks).float().mean().item()
    assert 0.4 < rate < 0.6


def test_a_k_changed_under_the_schedule_is_refused(fresh_accelerate_state):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
    data = token_dataset(N, seed=1)
    model = tiny_bert(seed=0)
    opt_cfg = OptimConfig(learning_rate=1e-3)
    optimizer = build_optimizer(model, opt_cfg)
    dl = DataLoader(data, batch_size=8, sampler=EpochSampler(len(data), seed=7, window_size=32), collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    plan = plan_updates(len(dl), 4, 2, None)
    scheduler = build_scheduler(optimizer, opt_cfg, plan)
    state = TrainState()
    train_one_epoch(model, optimizer, scheduler, dl, acc, 0, state=state, plan=plan)  # sized for k=4: fine
    acc.gradient_accumulation_steps = 2  # changed between epochs, as from a notebook
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"epoch 1: .*sized for k=4 \(6 updates.*accumulates 2.*plan.k_at"):
        train_one_epoch(model, optimizer, scheduler, dl, acc, 1, state=state, plan=plan)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any update
    resized = plan_updates(len(dl), 2, 2, None)
    scheduler = build_scheduler(optimizer, opt_cfg, resized)
    assert train_one_epoch(model, optimizer, scheduler, dl, acc, 1, state=state,
                           plan=resized).updates == 5  # ceil(10 / 2)
