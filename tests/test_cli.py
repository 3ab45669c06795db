"""End to end through `accelerate launch finetune/train.py` on a tiny random BERT, offline."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import yaml

import forked
from helpers import make_texts, offline_env, run_cli, save_tiny_model, write_tsv

pytestmark = pytest.mark.slow

N_ROWS = 150


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    model = save_tiny_model(root / "tiny-bert")
    data = write_tsv(root / "sms.csv", make_texts(N_ROWS, seed=3))
    return model, data


def write_config(path: Path, model: Path, data: Path, out: Path, **sections) -> Path:
    cfg = {
        "model": {"name_or_path": str(model)},
        "data": {"train_file": str(data), "format": "tsv", "has_header": False, "column_names": ["label", "text"],
                 "validation_split": 0.2, "max_length": 32},
        "training": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 3, "num_train_epochs": 2,
                     "per_device_eval_batch_size": 16, "seed": 5},
        "optim": {"learning_rate": 1e-3, "warmup_ratio": 0.1},
        "evaluation": {"metrics": ["accuracy", "f1"], "average": "binary", "positive_label": "spam"},
        "logging": {"report_to": ["tensorboard"], "progress_bar": False},
        "output": {"output_dir": str(out)},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(assets, tmp_path_factory):
    model, data = assets
    root = tmp_path_factory.mktemp("run")
    out = root / "out"
    cfg = write_config(root / "cfg.yaml", model, data, out)
    proc = run_cli(["--config", str(cfg)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_outputs_exist(trained):
    out, _ = trained
    for name in ("model.safetensors", "config.json", "tokenizer.json", "config.yaml", "train_log.jsonl",
                 "metrics.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "ham", "1": "spam"}


def test_one_log_record_per_update(trained):
    out, _ = trained
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    evals = [r for r in records if "eval/loss" in r]
    n_train = N_ROWS - round(0.2 * N_ROWS)  # stratified carve keeps 120 of 150 for training
    updates_per_epoch = math.ceil(math.ceil(n_train / 8) / 3)
    assert [r["step"] for r in train] == list(range(1, 2 * updates_per_epoch + 1))
    assert len(evals) == 2
    for r in train:
        assert set(r) >= {"train/loss", "train/lr", "train/grad_norm", "epoch", "step", "train/samples",
                          "train/tokens", "train/samples_per_s", "train/tokens_per_s"}
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
    assert train[updates_per_epoch - 1]["train/samples"] == n_train
    assert train[-1]["train/lr"] > 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["updates"] == 2 * updates_per_epoch
    # one field says how training ended, not two that can be read to disagree
    assert metrics["train"]["ended"] == "completed" and not {"stopped_early", "early_stopped"} & set(metrics["train"])
    assert set(metrics["eval"]) >= {"loss", "accuracy", "f1"}
    assert metrics["eval"]["num_samples"] == round(0.2 * N_ROWS)


def test_each_label_is_scored_alone_in_the_log_the_results_and_the_card(trained):
    out, _ = trained
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/loss" in r]
    metrics = json.loads((out / "metrics.json").read_text())
    for record in evals:
        by_label = record["eval_by_label"]
        assert list(by_label) == ["ham", "spam"]
        assert sum(s["support"] for s in by_label.values()) == record["eval/num_samples"]
        # a single label's true positives over all texts: the accuracy, whatever the averaging of f1
        hits = sum(s["recall"] * s["support"] for s in by_label.values())
        assert hits / record["eval/num_samples"] == pytest.approx(record["eval/accuracy"])
    assert metrics["eval_by_label"] == evals[-1]["eval_by_label"]  # the saved model's: the last evaluation's
    card = (out / "README.md").read_text()
    spam = metrics["eval_by_label"]["spam"]
    assert (f"| spam | {spam['precision']:.4f} | {spam['recall']:.4f} | {spam['f1']:.4f} | {spam['support']} |"
            in card)


def test_each_metric_has_its_bootstrap_interval_in_the_log_the_results_and_the_card(trained):
    import numpy as np

    out, proc = trained
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/loss" in r]
    metrics = json.loads((out / "metrics.json").read_text())
    # the run's last line: each score with its interval
    done = next(line for line in proc.stderr.splitlines() if "INFO finetune: done: " in line)
    for name, (low, high) in metrics["eval_intervals"].items():
        span = f"{low:.4f}-{high:.4f}" if low >= 0 else f"{low:.4f} to {high:.4f}"
        assert f"{name}={metrics['eval'][name]:.4f} ({span})" in done
    assert done.endswith(f"(95% bootstrap intervals over the validation texts) -> {out}")
    for record in evals:
        intervals = record["eval_intervals"]
        assert set(intervals) == {name for name in ("accuracy", "f1", "precision", "recall",
                                                    "matthews_correlation") if f"eval/{name}" in record}
        for name, (low, high) in intervals.items():
            assert (-1 if name == "matthews_correlation" else 0) <= low <= high <= 1, name
        # accuracy is a share of texts: its resamples' middle 95% holds the share itself
        low, high = intervals["accuracy"]
        assert low <= record["eval/accuracy"] <= high
    assert metrics["eval_intervals"] == evals[-1]["eval_intervals"]  # the saved model's
    # 30 texts: an accuracy interval of about the binomial's width (3.9 standard errors), not a rounding's, where
    # the model errs on some texts, and a point where it errs on none or on all
    accuracy = metrics["eval"]["accuracy"]
    low, high = metrics["eval_intervals"]["accuracy"]
    if 0 < accuracy < 1:
        assert high - low > 2 * np.sqrt(accuracy * (1 - accuracy) / metrics["eval"]["num_samples"])
    else:
        assert low == high == accuracy
    card = (out / "README.md").read_text()
    assert "| metric | value | 95% interval |" in card
    f1 = metrics["eval"]["f1"]
    assert f"| F1 | {f1:.4f} | {low_high(metrics['eval_intervals']['f1'])} |" in card


def low_high(interval):
    return f"{interval[0]:.4f} to {interval[1]:.4f}"


def test_resolved_config_written(trained):
    out, _ = trained
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["training"]["gradient_accumulation_steps"] == 3
    assert saved["training"]["mixed_precision"] == "auto"  # as configured; what it chose is in metrics.json


def test_auto_precision_is_decided_and_said(trained):
    import torch

    from finetune.precisions import choose_precision

    out, proc = trained
    chosen, why = choose_precision("auto", torch.device("cpu"))
    assert f"precision={chosen} ({why})" in proc.stderr  # the start line says what and why
    assert json.loads((out / "metrics.json").read_text())["train"]["mixed_precision"] == chosen


def test_pipeline_loads_the_model(trained):
    from transformers import pipeline

    out, _ = trained
    clf = pipeline("text-classification", model=str(out), device="cpu")
    preds = clf(["free cash prize call now", "see you at dinner tonight"])
    assert {p["label"] for p in preds} <= {"ham", "spam"}


def test_tensorboard_receives_the_records(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = trained
    events = list(out.rglob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    losses = acc.Scalars("train/loss")
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [e.step for e in losses] == [r["step"] for r in train]
    assert [e.value for e in losses] == pytest.approx([r["train/loss"] for r in train], rel=1e-6)


def test_module_form_and_overrides(assets, tmp_path):
    model, data = assets
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "cfg.yaml", model, data, out)
    proc = forked.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
         "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "finetune.train", "--config", str(cfg),
         "training.max_steps=2", "training.num_train_epochs=null", "logging.report_to=[]",
         "training.mixed_precision=bf16"],
        env=offline_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == [1, 2]
    assert yaml.safe_load((out / "config.yaml").read_text())["training"]["mixed_precision"] == "bf16"
    assert "k=3" in proc.stderr and "processes=1" in proc.stderr


def test_bad_key_is_one_line_and_touches_nothing(assets, trained, tmp_path):
    out, _ = trained
    model, data = assets
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cfg = write_config(tmp_path / "cfg.yaml", model, data, out, training={"per_device_train_bach_size": 4})
    proc = run_cli(["--config", str(cfg), "output.overwrite=true"])
    assert proc.returncode != 0  # accelerate's launcher turns every failure into 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    line = next(i for i, text in enumerate(cfg.read_text().splitlines(), 1) if "per_device_train_bach_size" in text)
    assert errors == [f"error: {cfg}:{line}: training.per_device_train_bach_size: unknown key "
                      f"(did you mean training.per_device_train_batch_size?)"]
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before


def test_non_empty_output_dir_is_refused(assets, trained, tmp_path):
    out, _ = trained
    model, data = assets
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".finetune.lock"}
    for overrides, message in (
        ({"output": {"output_dir": str(out), "resume_from": None}}, "is not empty"),
        ({"optim": {"learning_rate": 3e-4}}, "holds checkpoints of another run (optim.learning_rate: 0.001 -> 0.0003"),
    ):
        cfg = write_config(tmp_path / "cfg.yaml", model, data, out, **overrides)
        # without a launcher the script's own exit code (2: bad input) comes through
        proc = forked.run([sys.executable, "finetune/train.py", "--config", str(cfg)], env=offline_env(), timeout=300)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "output.output_dir" in proc.stderr and message in proc.stderr
        assert "Traceback" not in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".finetune.lock"} == before
