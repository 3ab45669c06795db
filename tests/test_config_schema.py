"""The typed schema: unknown keys, wrong types, bad values and overrides fail with the key's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from finetune.config import load_config, parse_override, read_yaml
from finetune.errors import ConfigError

BASE = """\
data:
  train_file: train.csv
training:
  per_device_train_batch_size: 8
"""


# the keys of the run features: accumulation schedule, class weights, problem types, best model
RUN_FEATURE_CASES = [
    (BASE + "  accumulation_schedule: {0: 0}\n", "training.accumulation_schedule: k must be >= 1, got 0 for epoch 0"),
    (BASE + "  accumulation_schedule: [8, 2]\n", "training.accumulation_schedule: expected mapping of int to int"),
    (BASE + "  class_weights: heavy\n", "training.class_weights: expected 'balanced' or mapping of str to float"),
    (BASE + "model:\n  problem_type: multiclass\n", "model.problem_type: expected one of"),
    (BASE + "model:\n  lora_alpha: 32\n",
     "model.lora_alpha: applies to LoRA adapters, and model.lora_rank is null (every weight trains)"),
    (BASE + "model:\n  lora_dropout: 0.1\n", "model.lora_dropout: applies to LoRA adapters"),
    (BASE + "model:\n  lora_target_modules: [query, value]\n", "model.lora_target_modules: applies to LoRA adapters"),
    (BASE.replace("data:\n", "data:\n  label_delimiter: ','\n"), "data.label_delimiter: splits multi_label labels only"),
    (BASE + "evaluation:\n  eval_every: 0\n", "evaluation.eval_every: must be >= 1 or null, got 0"),
    (BASE + "evaluation:\n  evals_per_epoch: 0\n", "evaluation.evals_per_epoch: must be >= 1 or null, got 0"),
    (BASE + "evaluation:\n  evals_per_epoch: 4\n  eval_every: 50\n",
     "evaluation.evals_per_epoch: set it or evaluation.eval_every, not both"),
    (BASE + "evaluation:\n  metric_for_best_model: bleu\n", "evaluation.metric_for_best_model: 'bleu' is not computed"),
    (BASE + "evaluation:\n  greater_is_better: sometimes\n", "evaluation.greater_is_better: expected bool or null"),
    (BASE + "evaluation:\n  load_best_model_at_end: 1\n", "evaluation.load_best_model_at_end: expected bool"),
    (BASE + "evaluation:\n  early_stopping_patience: 0\n", "evaluation.early_stopping_patience: must be >= 1"),
    (BASE + "evaluation:\n  early_stopping_threshold: -1\n", "evaluation.early_stopping_threshold: must be >= 0"),
    # a direction or a margin for evaluations that nothing compares: said, not ignored
    (BASE + "evaluation:\n  greater_is_better: true\n",
     "evaluation.greater_is_better: compares evaluations, and none is selected or stopped on"),
    (BASE + "evaluation:\n  early_stopping_threshold: 0.01\n",
     "evaluation.early_stopping_threshold: compares evaluations, and none is selected or stopped on"),
    (BASE.replace("data:\n", "data:\n  balance_micro_batches: sometimes\n"),
     "data.balance_micro_batches: expected bool or 'auto'"),
]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_and_types(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.data.num_workers == "auto" and cfg.evaluation.average == "auto"
    assert cfg.data.has_header is True  # no column_names: the file's first line is its header
    assert cfg.training.per_device_train_batch_size == 8
    assert cfg.training.mixed_precision == "auto"
    assert cfg.training.sparse_embedding_grad is True
    assert cfg.training.fast_dropout_masks is True
    assert cfg.training.cpu_heap == "auto"
    assert cfg.optim.learning_rate == 5e-5


@pytest.mark.parametrize(
    "text, needle",
    [
        (BASE + "  per_device_train_batchsize: 4\n", "training.per_device_train_batchsize: unknown key (did you mean training.per_device_train_batch_size?)"),
        (BASE + "  seed: abc\n", "training.seed: expected int, got str 'abc'"),
        (BASE + "  seed: 1.5\n", "training.seed: expected int"),
        (BASE + "  seed: true\n", "training.seed: expected int, got bool True"),  # not 1: YAML's true is no number
        (BASE + "optim:\n  learning_rate: .nan\n", "optim.learning_rate: must be a finite number, got nan"),
        (BASE + "  seed: -1\n", "training.seed: must be in [0, 2**32 - 1], got -1"),
        (BASE + "  seed: 4294967296\n", "training.seed: must be in [0, 2**32 - 1], got 4294967296"),
        (BASE + "  mixed_precision: fp8\n", "training.mixed_precision: expected one of"),
        (BASE + "optim:\n  learning_rate: -1\n", "optim.learning_rate: must be > 0"),
        (BASE + "optim:\n  warmup_ratio: 1.5\n", "optim.warmup_ratio: must be in [0, 1]"),
        (BASE + "optim:\n  lr_scheduler_type: cosin\n", "did you mean 'cosine'"),
        (BASE + "optim:\n  lr_scheduler_type: reduce_lr_on_plateau\n",
         "optim.lr_scheduler_type: 'reduce_lr_on_plateau' steps on a validation metric (metrics), and finetune "
         "steps the schedule once per optimizer update"),
        (BASE + "optim:\n  lr_scheduler_type: warmup_stable_decay\n",
         "optim.lr_scheduler_type: 'warmup_stable_decay' needs arguments of its own in optim.lr_scheduler_kwargs: "
         "get_wsd_schedule() missing 1 required positional argument: 'num_decay_steps'"),
        (BASE + "optim:\n  lr_scheduler_kwargs: {num_cycles: 2}\n",
         "optim.lr_scheduler_kwargs: the 'linear' schedule cannot be made with {'num_cycles': 2}: "),
        (BASE + "optim:\n  lr_scheduler_kwargs: 0.1\n",
         "optim.lr_scheduler_kwargs: expected mapping of str to int or float or str, got float 0.1"),
        (BASE + "optim:\n  layer_lr_decay: 1.2\n", "optim.layer_lr_decay: must be in (0, 1] (e.g. 0.9) or null, got 1.2"),
        (BASE + "optim:\n  layer_lr_decay: steep\n", "optim.layer_lr_decay: expected float or null"),
        (BASE + "  max_steps: 10\n  num_train_epochs: 2\n", "training.max_steps: set either"),
        (BASE + "modle:\n  name_or_path: x\n", "modle: unknown key (did you mean model?)"),
        ("training:\n  seed: 1\n", "data: required section is missing"),
        (BASE + "logging: 3\n", "logging: expected a mapping"),
        (BASE.replace("8", "0"), "training.per_device_train_batch_size: must be >= 1"),
        (BASE.replace("data:\n", "data:\n  length_group_windows: 0\n"), "data.length_group_windows: must be >= 1, got 0"),
        (BASE.replace("data:\n", "data:\n  pad_to_multiple_of: 0\n"), "data.pad_to_multiple_of: must be >= 1 (or null), got 0"),
        (BASE + "  sparse_embedding_grad: sometimes\n", "training.sparse_embedding_grad: expected bool, got str"),
        (BASE + "  fast_dropout_masks: 1\n", "training.fast_dropout_masks: expected bool, got int"),
        (BASE + "  cpu_heap: free\n", "training.cpu_heap: expected one of"),
        (BASE + "  mixed_precision: autom\n", "training.mixed_precision: expected one of"),
        (BASE.replace("data:\n", "data:\n  truncation: windows\n"), "data.truncation: expected one of"),
        (BASE.replace("data:\n", "data:\n  truncation: chunks\n  stride: 200\n"),
         "data.stride: must be >= 0 and smaller than data.max_length (128), got 200"),
        (BASE.replace("data:\n", "data:\n  stride: 16\n"), "data.stride: applies to data.truncation: chunks, not head"),
        (BASE.replace("data:\n", "data:\n  truncation: chunks\n  stride: half\n"), "data.stride: expected int or null"),
        (BASE.replace("data:\n", "data:\n  num_workers: many\n"), "data.num_workers: expected int or 'auto'"),
        (BASE.replace("data:\n", "data:\n  num_workers: -1\n"), "data.num_workers: must be >= 0, got -1"),
        (BASE.replace("data:\n", "data:\n  has_header: maybe\n"), "data.has_header: expected bool or null"),
        (BASE + "evaluation:\n  average: atuo\n", "did you mean 'auto'"),
    ] + RUN_FEATURE_CASES,
)
def test_bad_values_name_the_key_and_file(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert needle in message
    assert str(path) in message
    assert "\n" not in message


def test_a_lora_key_without_a_rank_says_both_ways_on(tmp_path):
    """Its hint serves both users: one who forgot the rank, one who turned a LoRA config's adapters off."""
    path = write(tmp_path, BASE + "model:\n  lora_rank: 8\n  lora_dropout: 0.1\n")
    assert load_config(path).model.lora_dropout == 0.1  # with a rank: taken
    with pytest.raises(ConfigError) as info:
        load_config(path, ["model.lora_rank=null"])
    assert info.value.hint == ("model.lora_rank=8 trains adapters of rank 8; without them, leave model.lora_dropout "
                               "out (or at 0.0)")


def test_yaml_no_means_the_string(tmp_path):
    cfg = load_config(write(tmp_path, BASE + "  mixed_precision: no\n"))
    assert cfg.training.mixed_precision == "no"
    assert cfg.training.sparse_embedding_grad is True


def test_overrides_are_typed(tmp_path):
    path = write(tmp_path, BASE)
    cfg = load_config(path, ["optim.learning_rate=3e-5", "training.seed=7", "logging.report_to=tensorboard",
                             "training.max_grad_norm=null"])
    assert cfg.optim.learning_rate == 3e-5 and isinstance(cfg.optim.learning_rate, float)
    assert cfg.training.seed == 7
    assert cfg.logging.report_to == ["tensorboard"]
    assert cfg.training.max_grad_norm is None


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.learning_rate", "missing '='"),
        ("optim.learning_rat=1", "optim.learning_rat: unknown key (did you mean optim.learning_rate?)"),
        ("optimizer.lr=1", "unknown section 'optimizer'"),
        ("lr=1", "expected section.key"),
        ("training.seed=abc", "training.seed: expected int"),
        ("optim.learning_rate=inf", "optim.learning_rate: must be a finite number, got inf"),
        ("training.gradient_checkpointing=maybe", "training.gradient_checkpointing: expected bool or 'auto'"),
        ("model.lora_rank=0", "model.lora_rank: must be at least 1 (or null to train every weight), got 0"),
        ("model.lora_rank=8.5", "model.lora_rank: expected int or null, got float 8.5"),
        ("model.lora_alpha=0", "model.lora_alpha: must be positive, got 0.0"),
        ("model.lora_dropout=1", "model.lora_dropout: must be in [0, 1), got 1.0"),
        ("model.lora_target_modules=[]", "model.lora_target_modules: an empty list adapts nothing"),
        ("model.lora_target_modules=7", "model.lora_target_modules: expected 'auto' or list of str"),
        ("training.lora_rank=8", "training.lora_rank: unknown key (did you mean model.lora_rank?)"),
        ("data.label_map={}", "data.label_map: an empty mapping names nothing"),
        ("data.label_map={1: a, '1': b}", "data.label_map: a label given twice, as a number and as a string"),
        ("data.label_map={0: ' '}", "data.label_map['0']: an empty name"),
        ("data.label_map=[a, b]", "data.label_map: expected mapping of int or str to str, got list"),
        ("data.drop_labels=[]", "data.drop_labels: an empty list leaves nothing out (null: none)"),
        ("data.drop_labels=[' ']", "data.drop_labels: an empty label"),
        ("data.on_missing_label=skip", "data.on_missing_label: expected one of 'error' | 'drop', got str 'skip'"),
        # YAML reads {0:8,4:2} as two keys without values: the line says how to write the mapping
        ("training.accumulation_schedule={0:8,4:2}", "YAML needs a space after each ':' of a mapping; "
                                                      "write training.accumulation_schedule=\"{0: 8, 4: 2}\""),
    ],
)
def test_bad_overrides(tmp_path, override, needle):
    with pytest.raises(ConfigError, match=None) as info:
        load_config(write(tmp_path, BASE), [override])
    assert needle in str(info.value)


def test_a_key_that_takes_text_gets_the_text_typed_where_yaml_would_read_another_scalar(tmp_path):
    # columns named as a header names them: a year, a yes/no word, an MRPC header's `#1 String` (a comment to
    # YAML, so null); the short flags (--text, --label, ...) become such overrides too
    cfg = load_config(write(tmp_path, BASE), ["data.label_column=2024", "data.text_column=no",
                                              "data.text_pair_column=#2 String", "data.label_delimiter=#",
                                              "model.problem_type=multi_label"])
    assert (cfg.data.label_column, cfg.data.text_column) == ("2024", "no")
    assert (cfg.data.text_pair_column, cfg.data.label_delimiter) == ("#2 String", "#")
    # null typed as such, a quoted value and every key that takes no text stay YAML's
    assert parse_override("data.text_pair_column=null") == ("data.text_pair_column", None)
    assert parse_override("data.text_pair_column='2024'") == ("data.text_pair_column", "2024")
    assert parse_override("training.seed=3") == ("training.seed", 3)
    assert parse_override("training.gradient_checkpointing=no") == ("training.gradient_checkpointing", False)
    assert load_config(write(tmp_path, BASE), ["optim.learning_rate=3e-5"]).optim.learning_rate == 3e-5
    # in a YAML file the value is YAML's, and the error says to quote it
    with pytest.raises(ConfigError, match=r"data\.label_column: expected str or list of str, got int 2024") as info:
        load_config(write(tmp_path, BASE.replace("data:\n", "data:\n  label_column: 2024\n")))
    assert info.value.hint == "YAML reads the word as int: quote it to mean the text"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "data: [unclosed\n"))
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_a_key_written_twice_is_refused_at_any_depth_and_a_merge_key_still_overrides(tmp_path):
    with pytest.raises(ConfigError, match=r"line 3 not valid YAML: 'seed' is written twice in one mapping "
                                          r"\(lines 2 and 3\)"):
        load_config(write(tmp_path, "training:\n  seed: 1\n  seed: 2\n"))
    with pytest.raises(ConfigError, match=r"'1' is written twice in one mapping \(line 1\)"):
        read_yaml(write(tmp_path, "training: {accumulation_schedule: {1: 8, 1: 2}}\n"))
    # `1` and `'1'` are different keys to YAML, and a merge key's values are there to be overridden
    merged = read_yaml(write(tmp_path, "base: &b {seed: 1, max_steps: 4}\ntraining:\n  <<: *b\n  seed: 2\n"
                                       "m: {1: a, '1': b}\n"))
    assert merged["training"] == {"seed": 2, "max_steps": 4}
    assert merged["m"] == {1: "a", "1": "b"}


def test_drop_labels_are_spelled_as_a_files_labels_and_regression_refuses_them(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["data.drop_labels=[-1, ' unsup ', unsup]"])
    assert cfg.data.drop_labels == ["-1", "unsup"]
    with pytest.raises(ConfigError, match=r"data\.drop_labels: names classes, and regression has none"):
        load_config(write(tmp_path, BASE), ["data.drop_labels=[3]", "model.problem_type=regression"])


def test_label_map_keys_are_spelled_as_a_files_labels_and_regression_refuses_it(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["data.label_map={0: negative, 1: ' positive '}"])
    assert cfg.data.label_map == {"0": "negative", "1": "positive"}  # as a label read from a file is spelled
    with pytest.raises(ConfigError, match=r"data\.label_map: names classes, and regression has none"):
        load_config(write(tmp_path, BASE), ["data.label_map={0: negative}", "model.problem_type=regression"])


def test_parse_override_keeps_strings():
    assert parse_override("model.name_or_path=bert-base-uncased") == ("model.name_or_path", "bert-base-uncased")
    assert parse_override("data.column_names=[label, text]") == ("data.column_names", ["label", "text"])


def test_parse_override_keeps_a_lone_yaml_marker():
    assert parse_override("data.label_delimiter=|") == ("data.label_delimiter", "|")
    assert parse_override("data.label_delimiter=>") == ("data.label_delimiter", ">")
    assert parse_override("data.label_delimiter=''") == ("data.label_delimiter", "")


def test_the_keys_of_the_run_features_have_defaults_and_typed_overrides(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.training.accumulation_schedule is None and cfg.training.class_weights is None
    assert cfg.model.problem_type == "single_label" and cfg.data.label_delimiter is None
    assert cfg.data.balance_micro_batches == "auto"
    e = cfg.evaluation
    assert (e.eval_every, e.metric_for_best_model, e.greater_is_better, e.load_best_model_at_end,
            e.early_stopping_patience, e.early_stopping_threshold) == (None, None, None, False, None, 0.0)
    cfg = load_config(write(tmp_path, BASE), [
        "training.accumulation_schedule={0: 4, 2: 1}", "training.class_weights={ham: 1, spam: 3}",
        "model.problem_type=multi_label", "training.class_weights=null", "data.label_delimiter=|",
        "evaluation.eval_every=50", "evaluation.metric_for_best_model=f1", "evaluation.early_stopping_patience=2",
        "data.balance_micro_batches=false",
    ])
    assert cfg.data.balance_micro_batches is False
    assert cfg.training.accumulation_schedule == {0: 4, 2: 1}
    assert cfg.model.problem_type == "multi_label" and cfg.data.label_delimiter == "|"
    assert (cfg.evaluation.eval_every, cfg.evaluation.metric_for_best_model) == (50, "f1")


# --------------------------------------------------------------------------- where a bad value came from

def test_an_override_error_names_the_command_line_not_the_file(tmp_path):
    path = write(tmp_path, "data:\n  train_file: x.csv\noptim:\n  learning_rate: 3.0e-5\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["optim.learnig_rate=1e-4"])
    assert exc.value.message == "command line: optim.learnig_rate: unknown key (did you mean optim.learning_rate?)"
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["optim.learning_rate=-1"])  # the file's own value was fine: the override is at fault
    assert exc.value.message.startswith("command line: optim.learning_rate: must be > 0")
    assert str(path) not in exc.value.message


def test_a_file_error_names_the_file_and_the_keys_line(tmp_path):
    path = write(tmp_path, "data:\n  train_file: x.csv\ntraining:\n  seed: 1\n  max_skipped: 0\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["training.seed=2"])
    assert exc.value.message == f"{path}:5: training.max_skipped: must be >= 1, got 0"


def test_a_section_that_is_not_a_mapping_is_named_with_its_file_with_or_without_an_override(tmp_path):
    path = write(tmp_path, "data:\n  train_file: x.csv\ntraining: 3\n")
    for overrides in ([], ["training.seed=1"]):
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: training: expected a mapping of keys, "
                                              rf"got int 3$"):
            load_config(path, overrides)


def test_a_key_in_the_wrong_section_is_told_its_section(tmp_path):
    path = write(tmp_path, "data:\n  train_file: x.csv\n")
    with pytest.raises(ConfigError, match=r"^command line: training.learning_rate: unknown key "
                                          r"\(did you mean optim.learning_rate\?\)$"):
        load_config(path, ["training.learning_rate=abc"])
    with pytest.raises(ConfigError, match=r"^command line: data.seed: unknown key \(did you mean training.seed\?\)$"):
        load_config(path, ["data.seed=1"])
    # misspelt as well (the Trainer keeps the rate beside the batch): the near miss of the other sections
    with pytest.raises(ConfigError, match=r"^command line: training.learning_rat: unknown key "
                                          r"\(did you mean optim.learning_rate\?\)$"):
        load_config(path, ["training.learning_rat=1e-5"])
    # a short name the scripts use, under any section: the key that does its work
    for section in ("training", "optim"):
        with pytest.raises(ConfigError, match=rf"^command line: {section}.lr: unknown key "
                                              r"\(lr is optim.learning_rate here\)$"):
            load_config(path, [f"{section}.lr=1e-5"])
    # nothing near anywhere: no guess
    with pytest.raises(ConfigError, match=r"^command line: training.qq: unknown key$"):
        load_config(path, ["training.qq=1e-5"])


@pytest.mark.parametrize("yaml_text, overrides, message", [
    ("", ["training.logging_steps=10"], "command line: training.logging_steps: unknown key (the Trainer's "
     "logging_steps is logging.log_every here; docs/trainer.md)"),
    ("", ["save_steps=100"], "override 'save_steps': expected section.key, one of sections data, model, training, "
     "optim, evaluation, logging, output (the Trainer's save_steps is output.checkpoint_every here; docs/trainer.md)"),
    ("bf16: true\n", [], "{path}: bf16: unknown key (the Trainer's bf16 is training.mixed_precision here; "
     "docs/trainer.md)"),
    ("learning_rate: 3.0e-5\n", [], "{path}: learning_rate: unknown key (did you mean optim.learning_rate?)"),
])
def test_a_trainer_argument_is_told_the_key_that_does_its_work(tmp_path, yaml_text, overrides, message):
    path = write(tmp_path, "data:\n  train_file: x.csv\n" + yaml_text)
    with pytest.raises(ConfigError) as exc:
        load_config(path, overrides)
    assert exc.value.message == message.format(path=path)


def test_an_error_in_a_key_with_digits_is_placed_where_it_was_set(tmp_path):
    # adam_beta1: the key's digits are part of its name when the error says where it came from
    path = write(tmp_path, "data:\n  train_file: x.csv\noptim:\n  adam_beta2: 0.999\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, ["optim.adam_beta1=2"])
    assert exc.value.message == "command line: optim.adam_beta1: must be in [0, 1), got 2.0"
    path = write(tmp_path, "data:\n  train_file: x.csv\noptim:\n  adam_beta2: 2\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, [])
    assert exc.value.message == f"{path}:4: optim.adam_beta2: must be in [0, 1), got 2.0"


def test_a_missing_data_file_from_the_command_line_is_blamed_on_it(tmp_path, capsys):
    from finetune.train import main

    missing = tmp_path / "mr_trian.csv"
    code = main(["--data", str(missing), "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith(f"error: command line: data.train_file: {missing}") and "not found" in err[-1]
    assert "default.yaml" not in err[-1]
    assert not (tmp_path / "out").exists()


# --- the learning-rate schedule ----------------------------------------------------------------------------------


def test_the_schedules_checked_without_transformers_are_plain_schedules_of_updates():
    """The names the config accepts without importing transformers: each one transformers knows, makes with
    no argument of its own and steps with none (the check that every other name goes through)."""
    from finetune.schema import PLAIN_SCHEDULES, check_schedule

    for name in PLAIN_SCHEDULES:
        check_schedule(name, {})


def test_a_schedules_own_arguments_reach_it(tmp_path):
    """warmup_stable_decay with num_decay_steps=4 over 12 updates: the peak rate after warmup, then down to 0
    over the last 4 updates."""
    import torch

    from finetune.optimization import build_scheduler, plan_updates

    cfg = load_config(write(tmp_path, BASE + "optim:\n  learning_rate: 1.0\n  lr_scheduler_type: warmup_stable_decay"
                                             "\n  lr_scheduler_kwargs: {num_decay_steps: 4}\n"))
    assert cfg.optim.lr_scheduler_kwargs == {"num_decay_steps": 4}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.optim.learning_rate)
    scheduler = build_scheduler(optimizer, cfg.optim, plan_updates(12, 1, 1, None, warmup_steps=2))
    rates = []
    for _ in range(12):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert rates[:2] == [0.0, 0.5] and rates[2:8] == [1.0] * 6
    assert rates[8] == 1.0 and 1.0 > rates[9] > rates[10] > rates[11] > 0.0


def test_a_config_is_checked_without_importing_torch_or_transformers():
    """Reading and checking a config takes no import of torch or transformers (seconds): a mistyped key or a
    value out of range is said at once."""
    from helpers import call_in_a_fresh_python

    config, imported, _ = call_in_a_fresh_python("finetune.config.load_config", "configs/default.yaml",
                                                  ["optim.lr_scheduler_type=cosine"])
    assert "lr_scheduler_type='cosine'" in config and imported == []
