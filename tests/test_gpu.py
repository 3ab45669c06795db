"""The accumulation contract on a CUDA GPU: fp32, bf16, fp16 with the grad scaler, fused AdamW, DDP over NCCL.

Marked ``gpu`` and skipped without CUDA; ``bench/gpu.sh`` runs them on a GPU
machine (``pytest -m gpu``), then the speed comparison.

Tolerances. In fp32 the weights of ``(b, k)`` and ``(b*k, 1)`` are compared
after every update with rtol 1e-5, as on the CPU: TF32 is off for these
tests (``torch.backends.cuda.matmul.allow_tf32 = False``, cuDNN's too), so
the two differ only by the order cuBLAS sums in for different batch shapes.
In bf16 the products round to 8 bits of mantissa, so the contract is checked
on the gradient an update applies (relative error of the whole gradient
below 2e-2), not on weights that Adam's normalisation would amplify.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from helpers import REPO, free_port, offline_env, pad_collate, tiny_bert, token_dataset, tsv_train_file

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("strict_fp32"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run bench/gpu.sh on a GPU machine)"),
]

N = 76  # b=8: 10 micro-batches, the last holding 4; k=4: windows of 4, 4 and 2 micro-batches


def _train(b: int, k: int, mixed_precision: str = "no", epochs: int = 2, lr: float = 1e-3, implementation="auto",
           kwargs_handlers=None, fusion: bool = False, attention_kernel: str = "auto", optimizer: str = "adamw"):
    """Train the tiny BERT on the GPU; record weights after and the gradient applied at every update
    (``fusion``: ``training.gradient_accumulation_fusion``; ``attention_kernel``: ``training.attention_kernel``)."""
    from accelerate import Accelerator

    from finetune.config import OptimConfig
    from finetune.loop import TrainState, train_one_epoch
    from finetune.optimization import build_optimizer, build_scheduler, plan_updates
    from finetune.sampling import EpochSampler

    acc = Accelerator(gradient_accumulation_steps=k, mixed_precision=mixed_precision,
                      kwargs_handlers=kwargs_handlers or [])
    assert acc.device.type == "cuda"
    data = token_dataset(N, seed=1)
    model = tiny_bert(seed=0)
    if fusion:
        from finetune.accumulation_fusion import fuse_weight_grads

        fuse_weight_grads(model)
    from finetune.attention_kernel import prefer_attention_kernel

    prefer_attention_kernel(model, attention_kernel)
    opt_cfg = OptimConfig(learning_rate=lr, lr_scheduler_type="linear", warmup_steps=1, weight_decay=0.01,
                          implementation=implementation, optimizer=optimizer)
    optimizer = build_optimizer(model, opt_cfg, device=acc.device)
    dl = DataLoader(data, batch_size=b, sampler=EpochSampler(len(data), seed=7, window_size=b * k),
                    collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)
    plan = plan_updates(len(dl), k, epochs, None, warmup_steps=1)
    scheduler = build_scheduler(optimizer, opt_cfg, plan)
    grads, weights, lrs, skipped = [], [], [], []
    step = optimizer.step

    def recording_step(*args, **kwargs):
        params = acc.unwrap_model(model).named_parameters()
        grads.append(torch.cat([p.grad.detach().float().flatten() for _, p in params]).cpu())
        lrs.append(optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    optimizer.step = recording_step

    scales = [acc.scaler.get_scale()] if acc.scaler is not None else []

    def on_update(state):
        if acc.scaler is not None:  # the scaler lowers its scale after an overflow, and only then
            scales.append(acc.scaler.get_scale())
            skipped.append(scales[-1] < scales[-2])
        weights.append({n: p.detach().float().cpu().clone() for n, p in acc.unwrap_model(model).named_parameters()})
        return False

    state = TrainState()
    for epoch in range(epochs):
        train_one_epoch(model, optimizer, scheduler, dl, acc, epoch, state=state, max_grad_norm=1.0,
                        on_update=on_update)
    return dict(grads=grads, weights=weights, lrs=lrs, skipped=skipped, scheduler=scheduler, plan=plan,
                optimizer=optimizer, state=state)


def test_fp32_windows_equal_the_big_batch_after_every_update():
    big, small = _train(32, 1), _train(8, 4)
    assert len(big["weights"]) == len(small["weights"]) == 6  # 3 updates per epoch, the last ragged
    for update, (a, b) in enumerate(zip(big["weights"], small["weights"])):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    assert small["scheduler"].get_last_lr()[0] == 0.0  # the schedule ends at the last update
    assert small["lrs"] == pytest.approx(big["lrs"], rel=1e-12)


def test_the_8bit_adamw_keeps_the_contract_with_its_state_counted_on_the_gpu(monkeypatch):
    """As on the CPU (tests/test_accumulation.py): the weights agree to 2e-5, the moments' quantization aside,
    and the state the optimizer allocates on the GPU is the plan's count."""
    import finetune.optimizer_state
    from finetune.optimizer_state import optimizer_state_bytes

    # the tiny model's matrices are under bitsandbytes' 4,096 elements: kept in 8 bits, as a full-sized model's
    monkeypatch.setattr(finetune.optimizer_state, "MIN_8BIT_SIZE", 256)
    big, small = _train(32, 1, optimizer="adamw_8bit"), _train(8, 4, optimizer="adamw_8bit")
    for update, (a, b) in enumerate(zip(big["weights"], small["weights"])):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=2e-5,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    optimizer = small["optimizer"].optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = [v for state in optimizer.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"]
    assert {v.device.type for v in held} == {"cuda"} and torch.uint8 in {v.dtype for v in held}
    assert sum(v.numel() * v.element_size() for v in held) == optimizer_state_bytes(params, "adamw_8bit")


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_bf16_windows_apply_the_big_batch_gradient():
    big, small = _train(32, 1, "bf16"), _train(8, 4, "bf16")
    assert len(big["grads"]) == len(small["grads"]) == 6
    errors = [_relative_error(s, b) for s, b in zip(small["grads"], big["grads"])]
    assert max(errors) < 2e-2, errors
    # the textbook recipe is off by far more on the ragged window (weight 1/k instead of 1/r): 2 of 4 micro-batches
    assert all(torch.isfinite(w).all() for update in small["weights"] for w in update.values())


def test_fused_weight_gradients_keep_the_contract_in_fp32_and_bf16():
    """``training.gradient_accumulation_fusion`` on CUDA: in fp32 (8, 4) trains (32, 1)'s weights after every
    update; in bf16 it applies the big batch's gradient within the tolerance above. The way this torch adds a
    bf16 product into an fp32 gradient is printed for the GPU check's log (``addmm`` fused in the product's
    epilogue, or a fallback), beside each update's error with and without the fusion."""
    import finetune.accumulation_fusion as fusion

    big, small = _train(32, 1, fusion=True), _train(8, 4, fusion=True)
    for update, (a, b) in enumerate(zip(big["weights"], small["weights"])):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    fused = [_relative_error(s, b) for s, b in zip(_train(8, 4, "bf16", fusion=True)["grads"],
                                                    _train(32, 1, "bf16", fusion=True)["grads"])]
    plain = [_relative_error(s, b) for s, b in zip(_train(8, 4, "bf16")["grads"], _train(32, 1, "bf16")["grads"])]
    ways = set(fusion._CUDA_WAYS.values())
    print(f"\ngradient_accumulation_fusion: {sorted(ways)}; (8, 4) against (32, 1) in bf16, each update's "
          f"gradient: fused {['%.1e' % e for e in fused]}, autograd's {['%.1e' % e for e in plain]}")
    assert len(fused) == 6 and max(fused) < 2e-2, fused
    assert ways and ways <= {"addmm", "mm", "upcast"}


def test_cudnns_attention_keeps_the_contract_in_bf16():
    """``training.attention_kernel: cudnn`` (a 16-bit kernel: bf16 is where it runs, tests/test_attention_kernel.py
    checks that it does) applies the big batch's gradient within the bf16 tolerance above; each update's error
    printed beside torch's own choice's for the GPU check's log."""
    cudnn = [_relative_error(s, b) for s, b in zip(_train(8, 4, "bf16", attention_kernel="cudnn")["grads"],
                                                   _train(32, 1, "bf16", attention_kernel="cudnn")["grads"])]
    plain = [_relative_error(s, b) for s, b in zip(_train(8, 4, "bf16")["grads"], _train(32, 1, "bf16")["grads"])]
    print(f"\nattention_kernel=cudnn: (8, 4) against (32, 1) in bf16, each update's gradient: "
          f"cudnn {['%.1e' % e for e in cudnn]}, torch's choice {['%.1e' % e for e in plain]}")
    assert len(cudnn) == 6 and max(cudnn) < 2e-2, cudnn


@pytest.mark.parametrize("implementation", ["fused", "for_loop"])
def test_fp16_overflow_skips_the_step_and_the_schedule(implementation):
    from accelerate.utils import GradScalerKwargs

    # a huge initial scale overflows fp16 gradients: the scaler skips steps, dividing the scale by 16 each time
    run = _train(8, 4, "fp16", epochs=4, implementation=implementation,
                 kwargs_handlers=[GradScalerKwargs(init_scale=2.0**32, backoff_factor=2**-4)])
    skipped = run["skipped"]
    assert skipped[0] and not all(skipped), skipped
    real_steps = skipped.count(False)
    # the scheduler advanced once per update the optimizer really made, never on a skipped one
    assert run["scheduler"].last_epoch == real_steps
    assert run["state"].step == len(skipped)
    # a skipped step left the weights as they were
    weights = [None] + run["weights"]
    for i, was_skipped in enumerate(skipped):
        if was_skipped and weights[i] is not None:
            assert all(torch.equal(weights[i + 1][n], w) for n, w in weights[i].items())
    # update j's learning rate is schedule(number of real steps before it)
    from transformers import get_scheduler

    reference = get_scheduler("linear", torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3),
                              num_warmup_steps=1, num_training_steps=run["plan"].total_updates)
    expected = []
    for was_skipped in skipped:
        expected.append(reference.get_last_lr()[0])
        if not was_skipped:
            reference.step()
    assert run["lrs"] == pytest.approx(expected, rel=1e-12)


def test_fused_adamw_is_chosen_on_cuda_and_matches_the_for_loop():
    from finetune.optimization import adamw_kernel

    assert adamw_kernel("auto", "cuda") == {"fused": True}
    fused, loop = _train(32, 1, epochs=1), _train(32, 1, epochs=1, implementation="for_loop")
    assert fused["optimizer"].optimizer.defaults.get("fused") is True
    assert not loop["optimizer"].optimizer.defaults.get("fused")
    for name, value in loop["weights"][-1].items():
        torch.testing.assert_close(fused["weights"][-1][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="DDP over NCCL needs 2 GPUs or more")
def test_ddp_over_nccl_gives_the_single_process_weights(tmp_path):
    from scaling_worker import record_run

    single = record_run(b=16, k=1)
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
           "--dynamo_backend", "no", str(REPO / "tests" / "scaling_worker.py"), "--out", str(out),
           "--b", "4", "--k", "2"]
    env = offline_env({"NVIDIA_TF32_OVERRIDE": "0"})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["backend"] == "nccl" for r in ranks)
    multi = torch.load(out / "snapshots.pt")
    assert len(multi) == len(single["snapshots"]) == 6
    for update, (a, b) in enumerate(zip(single["snapshots"], multi)):
        for name in a:
            torch.testing.assert_close(b[name].cpu(), a[name].cpu(), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    assert ranks[0]["scheduler_calls"] == 6


def _bf16_cli_run(tmp_path, texts: int, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """The default config's CLI run of the tiny BERT on ``texts`` generated rows, in bf16 at 32 tokens, with
    ``args`` after it; the finished process and the output folder."""
    from helpers import make_texts, save_tiny_model, write_tsv

    model_dir = save_tiny_model(tmp_path / "model")
    data = write_tsv(tmp_path / "train.tsv", make_texts(texts, seed=3))
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "finetune" / "train.py"), "--config", str(REPO / "configs" / "default.yaml"),
           f"model.name_or_path={model_dir}", tsv_train_file(data), f"output.output_dir={out}",
           "training.mixed_precision=bf16", "data.max_length=32", "logging.progress_bar=false", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=offline_env(), cwd=REPO, timeout=600), out


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_prediction_batches_padded_ahead_by_workers_give_the_logits_of_the_loop(tmp_path, precision):
    """On a GPU the Predictor's batches are padded by DataLoader workers into pinned memory and copied without
    waiting (``num_workers: auto``, here 2 by name); the logits are those of batches padded in the loop, bit for
    bit, under autocast too."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from finetune.predict import Predictor
    from helpers import make_texts, save_tiny_model

    folder = save_tiny_model(tmp_path / "tiny")
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2).cuda()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = [text for _, text in make_texts(200, seed=3)]
    here, ahead = (Predictor(model, tokenizer, batch_size=16, precision=precision, num_workers=workers)
                   for workers in (0, 2))
    assert here.device.type == "cuda" and ahead.collating_workers(13) == 2
    assert torch.equal(torch.from_numpy(ahead.logits(texts)), torch.from_numpy(here.logits(texts)))


def test_a_gpu_run_of_the_cli_trains_in_bf16_replayed_from_graphs(tmp_path):
    proc, out = _bf16_cli_run(tmp_path, 64, "training.num_train_epochs=2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "device=cuda" in proc.stderr and "precision=bf16" in proc.stderr
    # training.cuda_graphs: auto replays bf16 micro-batches from graphs on one GPU
    assert "cuda_graphs=on" in proc.stderr and "runs eagerly" not in proc.stderr
    graphs = json.loads((out / "metrics.json").read_text(encoding="utf-8"))["train"]["cuda_graphs"]
    assert graphs["lengths"] and graphs["pool_bytes"] > 0
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert all(0 < loss < 10 for loss in losses)
    assert (out / "model.safetensors").is_file()


def test_a_notebooks_loop_on_a_gpu_replays_from_graphs_as_fit_does(tmp_path, fresh_accelerate_state):
    """README's loop on one GPU in bf16: ``run.speedups()`` builds the graphs fit replays from, ``loop_settings``
    passes them, ``run.epochs()`` trains every planned update under an accumulation schedule; a loss of one's own
    handed to ``loop_settings`` is captured in graphs of its own."""
    from finetune.assembly import setup_run
    from finetune.config import load_config
    from finetune.loop import train_one_epoch
    from helpers import make_texts, save_tiny_model, write_tsv

    model_dir = save_tiny_model(tmp_path / "model")
    data = write_tsv(tmp_path / "train.tsv", make_texts(160, seed=3))
    cfg = load_config(str(REPO / "configs" / "default.yaml"), [
        f"model.name_or_path={model_dir}", tsv_train_file(data), f"output.output_dir={tmp_path / 'out'}",
        "training.mixed_precision=bf16", "data.max_length=32", "logging.progress_bar=false",
        "training.num_train_epochs=2", "training.accumulation_schedule={1: 2}"])
    run = setup_run(cfg)
    losses = []
    with run.speedups():
        assert run.graphs is not None and run.loop_settings()["graphs"] is run.graphs
        for epoch in run.epochs():
            train_one_epoch(run.model, run.optimizer, run.scheduler, run.train_dataloader, run.accelerator, epoch,
                            state=run.state, on_log=lambda r: losses.append(r["train/loss"]), **run.loop_settings())
    assert run.state.step == run.plan.total_updates == len(losses) and all(0 < loss < 10 for loss in losses)
    assert run.graphs.graphs and run.graphs.failed is None  # the micro-batches were replayed

    def doubled(logits, labels):
        return 2 * run.task.per_sample_loss(logits, labels)

    settings = run.loop_settings(loss_fn=doubled)
    assert settings["loss_fn"] is doubled and settings["graphs"].loss_fn is doubled and not settings["graphs"].graphs


def test_a_dry_run_on_a_gpu_replays_its_updates_and_says_their_memory_beside_the_plan(tmp_path):
    import re

    proc, out = _bf16_cli_run(tmp_path, 200, "--dry-run")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "cuda_graphs=on" in proc.stderr and not out.exists()
    line = next(line for line in proc.stderr.splitlines() if "dry run: " in line)
    peak, plan = map(float, re.search(r"GPU memory peaked at ([\d.]+)GB \(the plan: ([\d.]+)GB\)", line).groups())
    assert 0 < peak and 0 < plan
    assert re.search(r"dry run: 6 updates trained in [\d.]+ s \(loss [\d.]+ to [\d.]+\)", line), line


@pytest.mark.parametrize("graphed", [False, True])
def test_the_loop_waits_for_the_gpu_at_updates_not_at_micro_batches(tmp_path, fresh_accelerate_state, graphed):
    """A blocking copy of a micro-batch to the GPU, or a value read on the host, makes the host wait for every
    kernel queued before it. The run's loaders copy asynchronously and the loop reads the GPU when an update is
    made, not per micro-batch: once an update, for the window's totals and its gradient's norm together, where
    at k=8 a blocking copy alone would wait 8 times an update. Eager and replayed from CUDA graphs (the default
    here). Not the loop's: transformers' own forward reads the padding mask on the host to choose an attention
    kernel, and torch.cuda.graph synchronizes around each capture (once per length)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # bench/ is not part of the installed package
    from bench.common import host_waits
    from finetune.assembly import setup_run
    from finetune.config import load_config
    from finetune.cuda_graphs import graphs_for_run
    from finetune.loop import train_one_epoch
    from helpers import make_texts, save_tiny_model, write_tsv

    model_dir = save_tiny_model(tmp_path / "model")
    data = write_tsv(tmp_path / "train.tsv", make_texts(160, seed=3))
    cfg = load_config(str(REPO / "configs" / "default.yaml"), [
        f"model.name_or_path={model_dir}", tsv_train_file(data), f"output.output_dir={tmp_path / 'out'}",
        "training.per_device_train_batch_size=4", "training.effective_batch_size=32", "data.max_length=32",
        "data.num_workers=0", "training.mixed_precision=bf16", "logging.progress_bar=false"])
    run = setup_run(cfg)
    assert run.accelerator.dataloader_config.non_blocking
    graphs = graphs_for_run(run) if graphed else None
    assert (graphs is not None) == graphed
    result, waits = host_waits(lambda: train_one_epoch(
        run.model, run.optimizer, run.scheduler, run.train_dataloader, run.accelerator, 0, state=run.state,
        max_grad_norm=cfg.training.max_grad_norm, plan=run.plan, graphs=graphs))
    loop_waits = [w for w in waits if "/transformers/" not in w and "/torch/cuda/graphs.py" not in w]
    assert result.updates >= 4
    assert not graphed or graphs.graphs  # the micro-batches were replayed
    assert len(loop_waits) <= result.updates, (
        f"{len(loop_waits)} waits outside the model in {result.updates} updates of 8 micro-batches "
        f"({len(waits) - len(loop_waits)} in it): {sorted(set(loop_waits))}")
