"""FSDP, DeepSpeed ZeRO-2 and CUDA graphs on one GPU, launched with the shipped Accelerate configs.

Marked ``gpu`` and skipped without CUDA (``bench/gpu.sh`` runs them); the
DeepSpeed cases are skipped where ``deepspeed`` is not installed. Each setup
trains the same small job through ``accelerate launch --config_file
configs/accelerate/<config>.yaml --num_processes 1 finetune/train.py``: FSDP's
and DeepSpeed's configs, and the single-GPU config with
``training.cuda_graphs: true`` (every micro-batch replayed from a graph):

- the contract: ``(b, k) = (4, 4)`` against ``(16, 1)``, in fp32 with TF32
  and dropout off, so the two differ only by the order cuBLAS sums in for
  different batch shapes: every logged loss within rtol 1e-5 and every final weight within
  rtol 1e-5, atol 1e-6, as the CPU tests compare DDP (AdamW's update divides by
  the square root of the second moment, which turns a 1e-7 difference of a
  small gradient into at most about 1e-6 of a weight, hence the atol);
- a checkpoint and an exact resume: SIGTERM after update 3, then
  ``output.resume_from=latest`` writes the same model, bit for bit, and the
  same log as the run that was never stopped;
- the saved model loads in ``transformers.pipeline``, whose scores equal the
  package's own ``Predictor``'s.

The test logic was checked on a CPU, where these launches fall back to one
plain process (Accelerate runs neither engine there). One process shards
nothing, but on a GPU it runs the engine's code paths: FSDP2's
wrapped blocks, its no-sync accumulation and sharded checkpoints; DeepSpeed's
engine, its own gradient accumulation, clipping and checkpoint format.
DDP over NCCL needs two GPUs (tests/test_gpu.py); the gloo tests of
tests/test_scaling.py stand in for it on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.cuda_graphs import MAX_GRAPHS
from helpers import REPO, free_port, make_texts, offline_env, save_tiny_model, write_tsv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run bench/gpu.sh on a GPU machine)"),
]

ACCELERATE_CONFIGS = REPO / "configs" / "accelerate"
ENGINES = [
    pytest.param("fsdp", id="fsdp"),
    pytest.param("deepspeed_zero2", id="deepspeed", marks=pytest.mark.skipif(
        importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (bench/README.md)")),
    pytest.param("graphs", id="cuda-graphs"),
]
# each setup: its Accelerate config and the overrides it adds to the job
SETUPS = {"fsdp": ("fsdp", []), "deepspeed_zero2": ("deepspeed_zero2", []),
          "graphs": ("single_gpu", ["training.cuda_graphs=true"])}
DISTRIBUTED_TYPE = {"fsdp": "FSDP", "deepspeed_zero2": "DEEPSPEED", "graphs": "NO"}
TIMING_KEYS = {"train/samples_per_s", "train/tokens_per_s", "time", "seconds"}


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Path:
    """A tiny BERT and 80 labelled texts: 64 train in windows of 16 (4 updates an epoch), 2 epochs, fp32."""
    root = tmp_path_factory.mktemp("engines")
    model = save_tiny_model(root / "tiny-bert")
    data = write_tsv(root / "sms.tsv", make_texts(80, seed=3))
    cfg = {
        "model": {"name_or_path": str(model), "dropout": 0.1},  # dropout on: the resume restores its stream
        "data": {"train_file": str(data), "format": "tsv", "has_header": False, "column_names": ["label", "text"],
                 "validation_split": 0.2, "max_length": 32},
        "training": {"per_device_train_batch_size": 4, "effective_batch_size": 16, "num_train_epochs": 2,
                     "seed": 1, "mixed_precision": "no", "max_grad_norm": 1.0},
        "optim": {"learning_rate": 1e-3, "warmup_steps": 1},
        "evaluation": {"metrics": ["accuracy"]},
        "logging": {"progress_bar": False},
        "output": {"checkpoint_every": 2, "keep_last": 2},
    }
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def _launch(engine: str, job: Path, out: Path, *overrides: str, env: dict | None = None,
            script: Path = REPO / "finetune" / "train.py") -> subprocess.CompletedProcess:
    config, setup = SETUPS[engine]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ACCELERATE_CONFIGS / f"{config}.yaml"), "--num_processes", "1", "--main_process_port",
           str(free_port()), str(script), "--config", str(job), f"output.output_dir={out}", *setup, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=offline_env({"NVIDIA_TF32_OVERRIDE": "0", **(env or {})}))


def _succeeded(proc: subprocess.CompletedProcess) -> bool:
    """Whether a launch exited 0. When not, the end of its stderr is printed at once: bench/gpu.sh runs these
    tests with ``-s``, so a check its time limit cuts short still says why a launch failed."""
    if proc.returncode != 0:
        print(f"\nlaunch failed (exit {proc.returncode}): {' '.join(map(str, proc.args[-4:]))}\n"
              f"{proc.stderr[-4000:]}", flush=True)
    return proc.returncode == 0


def _records(out: Path) -> list[dict]:
    lines = (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


@pytest.fixture(scope="module")
def runs(job, tmp_path_factory):
    """Per engine, lazily: the reference run at (4, 4), trained once and shared by the tests."""
    cache: dict[str, Path] = {}

    def reference(engine: str) -> Path:
        if engine not in cache:
            out = tmp_path_factory.mktemp(f"{engine}-reference")
            proc = _launch(engine, job, out)
            assert _succeeded(proc), proc.stderr[-4000:]
            cache[engine] = out
        return cache[engine]

    return reference


@pytest.mark.parametrize("engine", ENGINES)
def test_the_engine_trains_and_is_recorded(engine, runs):
    metrics = json.loads((runs(engine) / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["train"]["distributed_type"] == DISTRIBUTED_TYPE[engine]
    assert metrics["train"]["updates"] == 8 and metrics["train"]["num_processes"] == 1
    assert metrics["train"]["gradient_accumulation_steps"] == 4
    graphs = metrics["train"]["cuda_graphs"]
    if engine == "graphs":  # texts of up to 32 tokens: at most MAX_GRAPHS lengths up to 32, of which the job meets some
        assert graphs["lengths"] and len(graphs["lengths"]) <= MAX_GRAPHS and max(graphs["lengths"]) <= 32
        assert graphs["capture_seconds"] > 0
        assert graphs["pool_bytes"] > 0  # the graphs' activations, which max_memory_allocated leaves out
    else:
        assert graphs is None


@pytest.mark.parametrize("setting", [True, "blocks"])
def test_compiled_graphs_train_through_the_cli_as_the_uncompiled_ones(setting, job, tmp_path):
    """``training.cuda_graphs`` with ``training.torch_compile`` (the whole forward, or each block): every
    micro-batch replayed from a graph of the compiled code, none eagerly, and the losses of the uncompiled graphs
    to the compiled kernels' rounding (dropout off: inductor draws its masks from other random numbers than
    eager kernels)."""
    plain, compiled = tmp_path / "plain", tmp_path / "compiled"
    for out, extra in ((plain, []), (compiled, [f"training.torch_compile={str(setting).lower()}"])):
        proc = _launch("graphs", job, out, "model.dropout=0", *extra)
        assert _succeeded(proc), proc.stderr[-4000:]
        assert "runs eagerly" not in proc.stderr, proc.stderr[-4000:]
    graphs = json.loads((compiled / "metrics.json").read_text(encoding="utf-8"))["train"]["cuda_graphs"]
    assert graphs["compiled"] == setting and graphs["lengths"] and graphs["capture_seconds"] > 0
    losses = [r["train/loss"] for r in _records(compiled) if "train/loss" in r]
    expected = [r["train/loss"] for r in _records(plain) if "train/loss" in r]
    assert len(losses) == 8 and losses == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_accumulated_windows_equal_the_big_batch(engine, job, tmp_path):
    # dropout off: its masks are drawn per micro-batch, so (4, 4) and (16, 1) would drop different units
    small, big = tmp_path / "small", tmp_path / "big"
    for out, b in ((small, 4), (big, 16)):
        proc = _launch(engine, job, out, f"training.per_device_train_batch_size={b}", "model.dropout=0")
        assert _succeeded(proc), proc.stderr[-4000:]
    small_log, big_log = _records(small), _records(big)
    losses = [(r["step"], r["train/loss"]) for r in small_log if "train/loss" in r]
    assert len(losses) == 8 and [s for s, _ in losses] == list(range(1, 9))
    expected = [r["train/loss"] for r in big_log if "train/loss" in r]
    assert [loss for _, loss in losses] == pytest.approx(expected, rel=1e-5)
    a, b = _weights(small), _weights(big)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stopped_run_resumes_to_the_same_model(engine, job, runs, tmp_path):
    reference = runs(engine)
    out = tmp_path / "stopped"
    worker = REPO / "tests" / "interrupt_worker.py"
    proc = _launch(engine, job, out, env={"FINETUNE_TEST_SIGNAL": "3:SIGTERM"}, script=worker)
    assert proc.returncode != 0
    assert "interrupted by SIGTERM after update 3" in proc.stderr, proc.stderr[-4000:]
    proc = _launch(engine, job, out, "output.resume_from=latest", script=worker)
    assert _succeeded(proc), proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert _records(out) == _records(reference)


@pytest.mark.parametrize("engine", ENGINES)
def test_the_saved_model_loads_in_a_pipeline(engine, runs):
    from transformers import pipeline

    from finetune.predict import Predictor

    out = runs(engine)
    texts = [text for _, text in make_texts(12, seed=9)]
    classify = pipeline("text-classification", model=str(out), device=0, top_k=None)
    predictor = Predictor.load(out)
    for text, scores, probabilities in zip(texts, classify(texts), predictor.probabilities(texts)):
        by_label = {s["label"]: s["score"] for s in scores}
        assert set(by_label) == set(predictor.labels)  # the run's label names, not LABEL_0, LABEL_1
        for label, p in zip(predictor.labels, probabilities):
            assert by_label[label] == pytest.approx(float(p), rel=1e-4, abs=1e-6), text
