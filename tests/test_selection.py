"""The best model, early stopping and evaluation every N updates.

The end-to-end run selects on the validation loss with ``greater_is_better:
true``: the loss falls as the model learns, so by that measure the run peaks
at its first evaluation, and everything after it is "no improvement". That
makes a run whose metric peaks early, deterministically: early stopping must
end it, the best checkpoint must survive ``keep_last: 1``, and the saved model
must be the best checkpoint's weights.
"""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from safetensors.torch import load_file

from finetune.checkpoint_files import list_checkpoints, prune
from finetune.config import EvalConfig, config_from_dict
from finetune.errors import ConfigError
from finetune.selection import Selection
import forked
from helpers import make_texts, offline_env, save_tiny_model, write_tsv
from test_checkpoint import _fake_checkpoint


def _history(*values, metric="f1"):
    return [{"step": 10 * (i + 1), f"eval/{metric}": v} for i, v in enumerate(values)]


def test_the_direction_follows_the_metric_unless_told():
    assert Selection.from_config(EvalConfig()) is None  # nothing asked: no selection
    assert Selection.from_config(EvalConfig(load_best_model_at_end=True)).describe() == "loss (lower is better)"
    assert Selection.from_config(EvalConfig(metric_for_best_model="eval/f1")).describe() == "f1 (higher is better)"
    assert not Selection.from_config(EvalConfig(metrics=["mse"], metric_for_best_model="mse")).greater_is_better
    told = EvalConfig(metric_for_best_model="loss", greater_is_better=True)
    assert Selection.from_config(told).greater_is_better


def test_an_improvement_must_beat_the_best_by_more_than_the_threshold():
    selection = Selection("f1", greater_is_better=True, patience=2, threshold=0.005)
    judgement = selection.judge(_history(0.5, 0.7, 0.69, 0.71, 0.705))
    # 0.71 beats 0.7 by 0.01 > 0.005; 0.705 does not beat 0.71
    assert (judgement.best_step, judgement.best_value, judgement.evaluations_since_best) == (40, 0.71, 1)
    assert not judgement.should_stop
    judgement = selection.judge(_history(0.5, 0.7, 0.703, 0.704))  # +0.003, +0.004: not enough
    assert (judgement.best_step, judgement.evaluations_since_best, judgement.should_stop) == (20, 2, True)
    assert "f1 has not improved on 0.7 (update 20) by more than 0.005 for 2 evaluations" in judgement.why_stopped()
    impatient = Selection("f1", greater_is_better=True, patience=1).judge(_history(0.5, 0.7, 0.6))
    assert "f1 has not improved on 0.7 (update 20) by more than 0 for 1 evaluation (" in impatient.why_stopped()
    # equal is no improvement, at no threshold (a plateau waits) or at a gain of exactly the threshold
    plateau = Selection("f1", greater_is_better=True, patience=2).judge(_history(0.5, 0.75, 0.75, 0.75))
    assert (plateau.best_step, plateau.evaluations_since_best, plateau.should_stop) == (20, 2, True)
    exactly = Selection("f1", greater_is_better=True, threshold=0.25).judge(_history(0.25, 0.5))
    assert (exactly.best_step, exactly.evaluations_since_best) == (10, 1)  # +0.25 is not more than 0.25
    lower = Selection("loss", greater_is_better=False)
    assert lower.judge(_history(0.9, 0.5, 0.6, metric="loss")).best_step == 20
    assert lower.judge(_history(float("nan"), 0.6, metric="loss")).best_step == 20  # NaN is never best
    with pytest.raises(ConfigError, match=r"metric_for_best_model: 'f1' is not among the evaluation's results \(loss\)"):
        selection.judge(_history(0.5, metric="loss"))


def test_pruning_keeps_the_best_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    paths = [_fake_checkpoint(root / f"checkpoint-{s}", s) for s in (2, 4, 6, 8)]
    prune(root, keep_last=2, keep={paths[-1], paths[0]})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-8"]
    prune(root, keep_last=1, keep={paths[-1], None})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-8"]


@pytest.mark.parametrize("evaluation, message", [
    ({"eval_every": 0}, r"evaluation.eval_every: must be >= 1 or null, got 0"),
    ({"early_stopping_patience": 0}, r"evaluation.early_stopping_patience: must be >= 1 or null, got 0"),
    ({"early_stopping_threshold": -0.1}, r"evaluation.early_stopping_threshold: must be >= 0, got -0.1"),
    ({"metric_for_best_model": "f2"}, r"evaluation.metric_for_best_model: 'f2' is not computed \(loss or one of "
                                      r"evaluation.metrics: accuracy, f1\)"),
    ({"greater_is_better": "yes"}, r"evaluation.greater_is_better: expected bool or null"),
    ({"load_best_model_at_end": True, "__output": {"save_checkpoints": False}},
     r"evaluation.load_best_model_at_end: needs output.save_checkpoints: true"),
])
def test_a_bad_selection_key_is_one_line_naming_it(evaluation, message):
    output = evaluation.pop("__output", {})
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"data": {"train_file": "x.tsv"}, "evaluation": evaluation, "output": output})


@pytest.mark.parametrize("evaluation, needs", [
    ({"load_best_model_at_end": True, "metric_for_best_model": "f1"},
     "load_best_model_at_end: compares evaluations on the validation texts"),
    ({"early_stopping_patience": 2}, "early_stopping_patience: compares evaluations on the validation texts"),
    ({"metric_for_best_model": "loss"}, "metric_for_best_model: compares evaluations on the validation texts"),
    ({"threshold": "per_label", "early_stopping_patience": 2},
     "threshold: per_label chooses thresholds on the validation texts"),
])
def test_a_key_that_needs_validation_texts_is_refused_where_there_are_none(evaluation, needs):
    """Without validation texts no evaluation is made: the best model, early stopping and the best evaluation
    would do nothing, unsaid, and per_label thresholds have nothing to be chosen on. Refused, naming the key; with
    validation texts, or without such a key, the run goes on."""
    from finetune.assembly import check_validation_is_there

    cfg = config_from_dict({"data": {"train_file": "x.tsv", "validation_split": 0}, "evaluation": evaluation})
    with pytest.raises(ConfigError) as refused:
        check_validation_is_there(cfg, {"train": []})
    assert refused.value.message == (f"evaluation.{needs}, and this run has none (data.validation_split is 0 and "
                                     "no validation file is given)")
    assert refused.value.hint == ("data.validation_split=0.1 holds out a tenth of the training rows, or give a "
                                  "validation file (--validation FILE)")
    check_validation_is_there(cfg, {"train": [], "validation": []})
    check_validation_is_there(config_from_dict({"data": {"train_file": "x.tsv", "validation_split": 0}}),
                              {"train": []})


@pytest.mark.parametrize("evaluation", [
    {"metric_for_best_model": "f1", "greater_is_better": True, "load_best_model_at_end": True,
     "early_stopping_patience": 2, "early_stopping_threshold": 0.01, "threshold": "per_label"},
    {"early_stopping_patience": 2, "early_stopping_threshold": 0.01},
    {"threshold": "per_label", "metrics": ["f1"]},
])
def test_the_keys_reset_for_a_run_without_validation_texts_make_a_config_it_accepts(evaluation):
    """What a run on every row (a sweep's model to keep) resets: each key that needs validation texts, and the keys
    that only mean something where evaluations are compared, which the config refuses once none is. Every other
    key stays as it was."""
    from finetune.assembly import check_validation_is_there
    from finetune.schema import EvalConfig

    evaluation = {"metrics": ["f1"], "eval_every": 5, **evaluation}
    cfg = config_from_dict({"data": {"train_file": "x.tsv", "validation_split": 0}, "evaluation": evaluation})
    unset = cfg.evaluation.unset_for_no_validation()
    assert set(unset) == set(evaluation) - {"metrics", "eval_every"}
    assert unset == {key: EvalConfig.__dataclass_fields__[key].default for key in unset}
    kept = config_from_dict({"data": {"train_file": "x.tsv", "validation_split": 0},
                             "evaluation": {**evaluation, **unset}})
    check_validation_is_there(kept, {"train": []})
    assert (kept.evaluation.metrics, kept.evaluation.eval_every) == (["f1"], 5)


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    root = tmp_path_factory.mktemp("selection")
    cfg = {
        "model": {"name_or_path": str(save_tiny_model(root / "tiny-bert"))},
        "data": {"train_file": str(write_tsv(root / "sms.tsv", make_texts(60, seed=3))), "format": "tsv",
                 "has_header": False, "column_names": ["label", "text"], "validation_split": 0.2, "max_length": 32},
        # 48 training rows, b=4, k=2: 6 updates per epoch, 18 planned
        "training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_train_epochs": 3,
                     "seed": 1, "mixed_precision": "no"},
        "optim": {"learning_rate": 3e-3},
        "evaluation": {"metrics": ["accuracy"], "average": "macro", "eval_every": 2,
                       "metric_for_best_model": "loss", "greater_is_better": True,
                       "load_best_model_at_end": True, "early_stopping_patience": 3},
        "logging": {"progress_bar": False},
        "output": {"keep_last": 1, "output_dir": str(root / "out")},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    proc = forked.run([sys.executable, "finetune/train.py", "--config", str(path)],
                      env=offline_env({"FINETUNE_CPU_THREADS": "1"}), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "out", proc.stderr


@pytest.mark.slow
def test_early_stopping_ends_a_run_that_peaked_and_keeps_the_best_model(peaked):
    out, stderr = peaked
    evals = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if '"eval/loss"' in line]
    # every 2 updates; the losses fall, so by "higher is better" the first evaluation stays the best
    assert [r["step"] for r in evals] == [2, 4, 6, 8]
    assert [r["is_best"] for r in evals] == [True, False, False, False]
    assert all(later["eval/loss"] < evals[0]["eval/loss"] for later in evals[1:])
    # three evaluations without improvement: stopped at update 8 of 18, with a line saying why
    assert "early stopping: loss has not improved on" in stderr and "(update 2)" in stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["updates"] == 8 and metrics["train"]["ended"] == "early_stopped"
    assert metrics["best"]["step"] == 2 and metrics["best"]["metric"] == "loss"
    assert metrics["eval"]["loss"] == evals[0]["eval/loss"]  # the saved model's metrics, not the last ones
    # the best checkpoint outlived keep_last: 1, and the shipped model is its weights
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-8"]
    best = load_file(out / "checkpoints" / "checkpoint-2" / "model.safetensors")
    last = load_file(out / "checkpoints" / "checkpoint-8" / "model.safetensors")
    shipped = load_file(out / "model.safetensors")
    assert set(shipped) <= set(best)
    assert all(shipped[k].equal(best[k]) for k in shipped)
    assert not all(shipped[k].equal(last[k]) for k in shipped)



@pytest.mark.slow
def test_the_output_folder_has_a_model_card_and_the_trainers_result_names(peaked):
    from finetune.config import load_config
    from finetune.outputs import MODEL_CARD_MARK

    out, _ = peaked
    metrics = json.loads((out / "metrics.json").read_text())
    results = json.loads((out / "all_results.json").read_text())
    assert results["train_runtime"] == pytest.approx(metrics["train"]["seconds"], abs=1e-3)
    assert results["train_samples_per_second"] == pytest.approx(metrics["train"]["samples"] / results["train_runtime"],
                                                                rel=1e-3)
    assert results["epoch"] == pytest.approx(8 / 6, abs=1e-3)  # 8 updates of 6 per epoch
    assert results["eval_loss"] == metrics["eval"]["loss"] and results["eval_accuracy"] == metrics["eval"]["accuracy"]
    assert results["eval_samples"] == 12 and results["train_samples"] == 48
    # the run's mean training loss: the sample-weighted mean of its update records
    train = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines() if "train/loss" in line]
    assert results["train_loss"] == pytest.approx(sum(r["train/loss"] * 8 for r in train) / (8 * len(train)), rel=1e-9)

    card = (out / "README.md").read_text()
    _, front, body = card.split("---\n", 2)
    meta = yaml.safe_load(front)
    assert meta["pipeline_tag"] == "text-classification" and "base_model" not in meta  # a local path is no Hub id
    reported = {m["type"]: m["value"] for m in meta["model-index"][0]["results"][0]["metrics"]}
    assert reported == {"loss": metrics["eval"]["loss"], "accuracy": metrics["eval"]["accuracy"]}
    assert body.startswith(MODEL_CARD_MARK)
    assert "2 labels: `ham`, `spam`" in body
    assert "4 x 2 x 1 = 8 samples per update (b x k x P)" in body
    assert "the best was at update 2" in body and "the weights here are the best evaluation's" in body
    # the reproduce command names a config that loads, into a new folder
    command = next(line for line in body.splitlines() if line.startswith("finetune train"))
    args = command.split()[2:]
    cfg = load_config(args[1], args[2:])
    assert cfg.output.output_dir == f"{out}-again" and cfg.evaluation.early_stopping_patience == 3


def test_a_readme_the_user_wrote_is_never_replaced(tmp_path):
    from finetune.outputs import MODEL_CARD_MARK
    from finetune.results import write_model_card

    mine = tmp_path / "README.md"
    mine.write_text("# my notes\n", encoding="utf-8")
    assert not write_model_card(mine, f"---\n---\n{MODEL_CARD_MARK}\ncard\n")
    assert mine.read_text() == "# my notes\n"
    ours = tmp_path / "ours.md"
    assert write_model_card(ours, f"---\n---\n{MODEL_CARD_MARK}\nold\n")
    assert write_model_card(ours, f"---\n---\n{MODEL_CARD_MARK}\nnew\n")  # a card of an earlier run is replaced
    assert ours.read_text().endswith("new\n")


def test_the_best_weights_load_where_the_accelerator_numbers_the_cpu(tmp_path):
    """A DDP job on the CPU has the device ``cpu:0``, a name safetensors refuses: the weights go to the model's."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_model

    from finetune.checkpoint import load_model_weights
    from helpers import tiny_bert

    best = tiny_bert(seed=1)
    save_model(best, str(tmp_path / "model.safetensors"))
    model = tiny_bert(seed=2)
    accelerator = SimpleNamespace(device=torch.device("cpu", 0), unwrap_model=lambda m: m)
    load_model_weights(SimpleNamespace(model=model, accelerator=accelerator), tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), best.state_dict().values()))
    assert not torch.equal(tiny_bert(seed=2).classifier.weight, best.classifier.weight)
