"""Every bad input gets a clear answer (issue 5): one table of bad configs, data, models and launches.

Each row runs ``finetune.train.main`` in this process (it returns the exit code
and prints ``error: ...`` and maybe ``hint: ...``) and asserts:

* exit code 2 (the code of every :class:`~finetune.errors.FinetuneError`);
* the error line names the culprit: config key and file, data file and row or
  column, label value, model path;
* no traceback, and the error (plus at most one hint) is the last thing on stderr;
* a pre-existing output directory (sentinel, an earlier model and log, a
  checkpoint) is unchanged byte for byte;
* nothing was tokenized and no training started: every one of these errors is
  knowable up front, before minutes of work.

A few representative cases then run as real subprocesses, where the exit code
and the launcher's behaviour are what a user sees.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import datasets
import pytest
import torch
import yaml

import finetune.data
import finetune.tokens
import finetune.fitting
from finetune.errors import DataError
from finetune.train import main
from helpers import make_texts, run_cli, save_tiny_model, tiny_bert, write_csv

NON_UTF8 = b"text,label\nhello there,ham\ncaf\xe9 au lait,spam\nwin cash now,spam\n"


# --------------------------------------------------------------------------- the table


def _zipped(files: dict[str, str]) -> bytes:
    """A .zip of ``files``, as bytes to write."""
    packed = io.BytesIO()
    with zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return packed.getvalue()


@dataclass
class Case:
    """One bad input and what its error line must say.

    Strings may use ``{root}`` (the case's own folder), ``{cfg}`` (its config
    file), ``{train}`` (a good training CSV), ``{model}`` (a tiny BERT),
    ``{ckpt3}`` (a 3-label classifier checkpoint) and ``{nowt}`` (a model
    folder without weights).

    Args:
        id: Test id.
        needles: Substrings the ``error:`` line must contain.
        config: Merged into the good base config, section by section.
        text: Written as the config file instead (for files that are not a config).
        overrides: Dotted command-line overrides.
        files: Files written under ``{root}`` first (str or bytes).
        config_path: Passed as ``--config`` instead of the written file.
        hint: Substring the ``hint:`` line must contain (None: no hint required).
        processes: Simulate a launch with this many processes on a CPU (see ``simulated_launch``).
    """

    id: str
    needles: list[str]
    config: dict[str, dict[str, Any]] = field(default_factory=dict)
    text: Optional[str] = None
    overrides: list[str] = field(default_factory=list)
    files: dict[str, str | bytes] = field(default_factory=dict)
    config_path: Optional[str] = None
    hint: Optional[str] = None
    processes: Optional[int] = None


CASES = [
    # ---- config
    Case("config-missing", ["config file not found", "{root}/nope.yaml"], config_path="{root}/nope.yaml"),
    Case("config-is-a-folder", ["config file {root}", "not a file"], config_path="{root}"),
    Case("config-not-yaml", ["{cfg}", "line 2", "not valid YAML", "'\\t'"], text="data:\n\ttrain_file: a.csv\n"),
    # PyYAML alone keeps the second `training:` and drops every key of the first
    Case("config-section-twice", ["{cfg}", "line 4", "'training' is written twice", "lines 1 and 4"],
         text="training:\n  seed: 3\ndata: {}\ntraining:\n  max_steps: 2\n"),
    Case("config-not-a-mapping", ["{cfg}", "expected a mapping of sections", "list"], text="- data\n- model\n"),
    Case("config-unknown-key",
         ["{cfg}", "training.per_device_train_bach_size: unknown key",
          "did you mean training.per_device_train_batch_size?"],
         config={"training": {"per_device_train_bach_size": 4}}),
    Case("config-wrong-type", ["{cfg}", "training.seed", "expected int", "'abc'"],
         config={"training": {"seed": "abc"}}),
    Case("config-negative-learning-rate", ["{cfg}", "optim.learning_rate", "must be > 0", "-1e-05"],
         config={"optim": {"learning_rate": -1e-5}}),
    Case("config-zero-batch-size", ["{cfg}", "training.per_device_train_batch_size", "must be >= 1", "got 0"],
         config={"training": {"per_device_train_batch_size": 0}}),
    Case("config-warmup-ratio-above-1", ["{cfg}", "optim.warmup_ratio", "[0, 1]", "1.5"],
         config={"optim": {"warmup_ratio": 1.5}}),
    Case("config-max-length-above-position-limit", ["{cfg}", "data.max_length", "100", "64", "{model}"],
         config={"data": {"max_length": 100}}, hint="at most 64"),
    Case("config-effective-batch-contradicts-accumulation",
         ["{cfg}", "training.gradient_accumulation_steps", "3", "effective_batch_size 8"],
         config={"training": {"effective_batch_size": 8, "gradient_accumulation_steps": 3}}),
    Case("config-max-steps-and-epochs", ["{cfg}", "training.max_steps", "training.num_train_epochs", "not both"],
         config={"training": {"max_steps": 5, "num_train_epochs": 1}}),
    Case("override-without-equals", ["override 'optim.learning_rate'", "missing '='"],
         overrides=["optim.learning_rate"]),
    Case("override-unknown-key", ["optim.learning_rat: unknown key", "did you mean optim.learning_rate?"],
         overrides=["optim.learning_rat=3e-5"]),
    Case("override-unknown-section",
         ["override 'optimizer.learning_rate'", "unknown section 'optimizer'", "did you mean optim?"],
         overrides=["optimizer.learning_rate=3e-5"]),
    Case("config-unknown-metric", ["{cfg}", "evaluation.metrics", "'acuracy'", "did you mean 'accuracy'?"],
         config={"evaluation": {"metrics": ["acuracy"]}}, hint="Built in (offline)"),
    Case("config-unknown-tracker", ["{cfg}", "logging.report_to", "'tensorbord'", "did you mean 'tensorboard'?"],
         config={"logging": {"report_to": ["tensorbord"]}}),
    Case("config-positive-label-not-in-data", ["{cfg}", "evaluation.positive_label", "'spm'", "ham, spam"],
         config={"evaluation": {"metrics": ["f1"], "average": "binary", "positive_label": "spm"}}),
    Case("config-output-dir-under-a-file", ["{cfg}", "output.output_dir", "{root}/notes.txt is a file"],
         config={"output": {"output_dir": "{root}/notes.txt/run"}}, files={"notes.txt": "a file, not a folder"}),
    Case("config-lora-target-matches-nothing",
         ["{cfg}", "model.lora_target_modules: 'qkv' matches no module of BertForSequenceClassification",
          "auto would adapt query, key, value"],
         config={"model": {"lora_rank": 4, "lora_target_modules": ["qkv"]}}),
    Case("config-lora-rank-zero", ["{cfg}", "model.lora_rank: must be at least 1", "got 0"],
         config={"model": {"lora_rank": 0}}),
    # ---- data
    Case("data-file-missing", ["{cfg}", "data.train_file", "{root}/missing.csv", "not found"],
         config={"data": {"train_file": "{root}/missing.csv"}}),
    Case("data-folder-missing", ["{cfg}", "data.train_file", "{root}/corpus", "not found"],
         config={"data": {"train_file": "{root}/corpus", "format": "folder"}}),
    Case("data-file-a-hub-id", ["{cfg}", "data.train_file", "someone/reviews", "not found"],
         config={"data": {"train_file": "someone/reviews"}},
         hint="a Hugging Face Hub data set is data.dataset_name=someone/reviews"),
    # the suite runs offline: a URL is named with how to download it
    Case("data-file-a-url", ["{cfg}", "data.train_file: cannot download https://example.com/d/reviews.csv?raw=1: "
                             "OfflineModeIsEnabled"],
         config={"data": {"train_file": "https://example.com/d/reviews.csv?raw=1"}},
         hint="HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: unset it for the download, which later runs reuse"),
    Case("data-unsupported-extension", ["data.train_file", "{root}/train.ods", "unsupported extension '.ods'"],
         config={"data": {"train_file": "{root}/train.ods"}}, files={"train.ods": "text,label\nhi,ham\n"},
         hint="save the spreadsheet as an Excel workbook (.xlsx) or as CSV"),
    Case("data-not-a-workbook", ["{root}/train.xlsx", "cannot read as an Excel workbook: BadZipFile"],
         config={"data": {"train_file": "{root}/train.xlsx"}}, files={"train.xlsx": "text,label\nhi,ham\n"}),
    Case("data-empty-file", ["{root}/empty.csv", "empty file"],
         config={"data": {"train_file": "{root}/empty.csv"}}, files={"empty.csv": ""}),
    Case("data-text-column-missing", ["{train}", "no column 'sms'", "data.text_column", "columns found: text, label"],
         config={"data": {"text_column": "sms"}}, hint="by the values, try --text text (data.text_column=text)"),
    Case("data-drop-labels-not-in-the-data",
         ["data.drop_labels: 'unsup' not among the labels of {train}", "(ham, spam)"],
         overrides=["data.drop_labels=[unsup]"]),
    Case("data-rows-without-a-label",
         ["{root}/part.csv", "1 row without a label in column 'label' (line 3)"],
         config={"data": {"train_file": "{root}/part.csv"}}, files={"part.csv": "text,label\nhi,ham\nyo,\nwin,spam\n"},
         hint="data.on_missing_label=drop leaves those rows out (a file labelled in part trains on its labelled rows)"),
    Case("data-label-column-missing",
         ["{train}", "no column 'category'", "data.label_column", "columns found: text, label"],
         config={"data": {"label_column": "category"}}, hint="try --label label (data.label_column=label)"),
    Case("data-empty-texts",
         ["{root}/blanks.csv", "2 empty or null texts", "column 'text'", "lines 3, 5", "data.on_empty_text: drop"],
         config={"data": {"train_file": "{root}/blanks.csv"}},
         files={"blanks.csv": 'text,label\nhello there,ham\n,spam\nfree cash now,spam\n"   ",ham\nsee you,ham\n'}),
    Case("data-validation-label-not-in-train",
         ["{root}/val.csv", "label 'eggs'", "line 4", "not among the 2 labels of the train data (ham, spam)"],
         config={"data": {"validation_file": "{root}/val.csv"}},
         files={"val.csv": "text,label\nhello,ham\nwin cash,spam\nfried,eggs\n"}),
    Case("data-label-lists-without-multi-label",
         ["{root}/tags.jsonl", "label ['money'] at line 1", "column 'label'", "is a list, not a class"],
         config={"data": {"train_file": "{root}/tags.jsonl"}}, hint="set model.problem_type=multi_label",
         files={"tags.jsonl": '{"text": "hello there", "label": ["money"]}\n'
                              '{"text": "win cash now", "label": ["money", "hurry"]}\n'}),
    Case("data-label-numbers-without-regression", ["{root}/scores.csv", "label 0.25 at line 3", "is not a class"],
         config={"data": {"train_file": "{root}/scores.csv"}}, hint="set model.problem_type=regression",
         files={"scores.csv": "text,label\nhello there,1\nwin cash now,0.25\n"}),
    Case("data-only-one-class", ["{root}/one.csv", "only one class", "'ham'"],
         config={"data": {"train_file": "{root}/one.csv"}},
         files={"one.csv": "text,label\n" + "".join(f"hello {i},ham\n" for i in range(10))}),
    Case("data-not-utf8", ["{root}/latin1.csv", f"byte offset {NON_UTF8.index(0xE9)}", "not UTF-8"],
         config={"data": {"train_file": "{root}/latin1.csv"}}, files={"latin1.csv": NON_UTF8},
         hint="a spreadsheet's plain CSV on Windows is data.encoding=cp1252"),
    Case("config-unknown-encoding", ["{cfg}", "data.encoding: 'klingon' is no text encoding Python knows"],
         config={"data": {"encoding": "klingon"}}),
    Case("data-folder-without-txt", ["{root}/classes", "no .txt files"],
         config={"data": {"train_file": "{root}/classes"}},
         files={"classes/ham/a.md": "hello", "classes/spam/b.md": "win cash"}),
    Case("data-archive-of-several-files", ["data.train_file", "{root}/contest.zip holds 2 data files",
                                           "{root}/contest.zip/test.csv", "name one"],
         config={"data": {"train_file": "{root}/contest.zip"}},
         files={"contest.zip": _zipped({"train.csv": "text,label\nhi,ham\n", "test.csv": "text,label\nyo,ham\n"})},
         hint="by its path in the archive: {root}/contest.zip/train.csv"),
    Case("data-archive-member-missing", ["data.train_file", "{root}/contest.zip holds no trian.csv"],
         config={"data": {"train_file": "{root}/contest.zip/trian.csv"}},
         files={"contest.zip": _zipped({"train.csv": "text,label\nhi,ham\n"})},
         hint="did you mean {root}/contest.zip/train.csv?"),
    Case("data-archive-cut-short", ["data.train_file", "{root}/cut.zip: cannot unpack: BadZipFile"],
         config={"data": {"train_file": "{root}/cut.zip"}},
         files={"cut.zip": _zipped({"train.csv": "text,label\n" + "hi,ham\n" * 50})[:60]},
         hint="unzip -t {root}/cut.zip tests it"),
    Case("data-cache-dir-not-writable", ["data.cache_dir", "{train}/cache", "cannot write tokenized splits"],
         config={"data": {"cache_dir": "{train}/cache"}}),
    # ---- model
    Case("model-path-missing", ["{cfg}", "model.name_or_path", "{root}/no-model", "not found"],
         config={"model": {"name_or_path": "{root}/no-model"}}),
    Case("model-folder-not-a-model", ["{cfg}", "model.name_or_path", "{root}/notes", "not a model"],
         config={"model": {"name_or_path": "{root}/notes"}}, files={"notes/readme.md": "not a model"}),
    Case("tokenizer-folder-not-a-tokenizer",
         ["{cfg}", "model.tokenizer_name_or_path", "{root}/notes", "not a tokenizer (no tokenizer_config.json"],
         config={"model": {"tokenizer_name_or_path": "{root}/notes"}}, files={"notes/readme.md": "not one"}),
    Case("model-path-mistyped-as-hub-id", ["{cfg}", "model.name_or_path", "no-such-dir/tiny-bert"],
         config={"model": {"name_or_path": "no-such-dir/tiny-bert"}}, hint="not a local path"),
    Case("model-without-weights", ["{cfg}", "model.name_or_path", "{nowt}", "model.safetensors"],
         config={"model": {"name_or_path": "{nowt}"}}),
    Case("model-label-count-mismatch", ["{cfg}", "model.name_or_path", "{ckpt3}", "3 labels", "the data has 2"],
         config={"model": {"name_or_path": "{ckpt3}"}}, hint="model.ignore_mismatched_sizes: true"),
    # ---- launch
    Case("launch-more-processes-than-batch-splits",
         ["{cfg}", "training.effective_batch_size", "8", "4 processes", "per_device_train_batch_size 4"],
         config={"training": {"effective_batch_size": 8}}, processes=4, hint="a multiple of 16"),
    Case("launch-fp16-on-cpu", ["{cfg}", "training.mixed_precision", "fp16", "CPU"],
         config={"training": {"mixed_precision": "fp16"}}, processes=1),
]
CASES_BY_ID = {case.id: case for case in CASES}


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path_factory, monkeypatch):
    """Keep the Arrow caches `load_dataset` writes out of the user's ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, str]:
    """A tiny BERT, a 3-label checkpoint of it, a model folder without weights, a good CSV."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("assets")
    model = save_tiny_model(root / "tiny-bert")
    ckpt3 = root / "ckpt-3-labels"
    tiny_bert(num_labels=3).save_pretrained(ckpt3)
    AutoTokenizer.from_pretrained(model).save_pretrained(ckpt3)
    nowt = root / "no-weights"
    shutil.copytree(model, nowt)
    (nowt / "model.safetensors").unlink()
    train = write_csv(root / "train.csv", make_texts(40, seed=1))
    return {"model": str(model), "ckpt3": str(ckpt3), "nowt": str(nowt), "train": str(train)}


@pytest.fixture
def work(monkeypatch):
    """Record tokenization and training instead of letting them go unnoticed.

    ``fit`` is replaced (no test here may train); ``tokenize_splits`` still runs,
    so the good-config control below behaves like a real start-up.
    """
    calls: list[str] = []
    tokenize = finetune.tokens.tokenize_splits

    def spy_tokenize(*args, **kwargs):
        calls.append("tokenize")
        return tokenize(*args, **kwargs)

    def spy_fit(run, *args, **kwargs):
        calls.append("fit")
        return {}

    monkeypatch.setattr(finetune.tokens, "tokenize_splits", spy_tokenize)
    monkeypatch.setattr(finetune.fitting, "fit", spy_fit)
    return calls


def simulated_launch(monkeypatch, processes: int) -> None:
    """Make Accelerate report ``processes`` processes on the CPU, as ``accelerate launch`` would.

    This machine has 2 cores and no GPU, and a real multi-process launch costs
    seconds per process; the checks under test read only the process count and
    the device of Accelerate's state, so a stand-in state is enough. The device
    is the CPU whatever this machine has, so fp16 fails the same way on a GPU host.
    """
    import accelerate

    class FakeState:
        num_processes = processes
        process_index = 0
        local_process_index = 0
        is_main_process = True
        is_local_main_process = True
        device = torch.device("cpu")
        distributed_type = "MULTI_CPU" if processes > 1 else "NO"
        backend = "gloo" if processes > 1 else None

        def __init__(self, *args, **kwargs):
            pass

        @classmethod
        def _reset_state(cls, *args, **kwargs):
            pass

    monkeypatch.setattr(accelerate, "PartialState", FakeState)
    if processes > 1:
        monkeypatch.setenv("WORLD_SIZE", str(processes))  # what torchrun tells every process


def base_config(assets: dict[str, str], out: Path) -> dict[str, dict[str, Any]]:
    """A config that starts fine: tiny model, 40 rows, two classes, no trackers."""
    return {
        "model": {"name_or_path": assets["model"]},
        "data": {"train_file": assets["train"], "validation_split": 0.2, "max_length": 32},
        "training": {"per_device_train_batch_size": 4, "num_train_epochs": 1},
        "evaluation": {"metrics": ["accuracy"]},
        "logging": {"progress_bar": False, "report_to": []},
        "output": {"output_dir": str(out), "overwrite": True},
    }


def earlier_output(out: Path) -> None:
    """What an earlier run left: its model, log, metrics, a checkpoint and a sentinel."""
    (out / "checkpoint-3").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"\x00earlier weights\xff" * 64)
    (out / "train_log.jsonl").write_text('{"step": 1, "train/loss": 0.69}\n', encoding="utf-8")
    (out / "metrics.json").write_text('{"eval": {"accuracy": 0.5}}\n', encoding="utf-8")
    (out / "checkpoint-3" / "optimizer.bin").write_bytes(bytes(range(256)))
    (out / "SENTINEL").write_text("do not touch\n", encoding="utf-8")


def snapshot(root: Path) -> dict[str, Optional[bytes]]:
    """Every path under ``root`` with its bytes (None for folders)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def fill(value: Any, names: dict[str, str]) -> Any:
    """``value`` with ``{name}`` placeholders filled in, through lists and dicts."""
    if isinstance(value, str):
        return value.format(**names)
    if isinstance(value, list):
        return [fill(v, names) for v in value]
    if isinstance(value, dict):
        return {k: fill(v, names) for k, v in value.items()}
    return value


def prepare(case: Case, assets: dict[str, str], root: Path) -> tuple[list[str], dict[str, str], Path]:
    """Write the case's files, config and earlier output; return argv, placeholder values and output dir."""
    out = root / "out"
    earlier_output(out)
    cfg_path = root / "config.yaml"
    names = {**assets, "root": str(root), "cfg": str(cfg_path)}
    for name, content in case.files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8")
    if case.text is not None:
        cfg_path.write_text(case.text, encoding="utf-8")
    else:
        cfg = copy.deepcopy(base_config(assets, out))
        for section, values in fill(case.config, names).items():
            cfg.setdefault(section, {}).update(values)
        cfg_path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    config_arg = fill(case.config_path, names) if case.config_path else str(cfg_path)
    return ["--config", config_arg, *fill(case.overrides, names)], names, out


def error_lines(stderr: str) -> tuple[str, Optional[str]]:
    """The ``error:`` line and the ``hint:`` line, checking they are the only ones and come last."""
    lines = stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(errors) == 1, stderr
    tail = lines[errors[0]:]
    assert len(tail) == 1 or (len(tail) == 2 and tail[1].startswith("hint: ")), stderr
    return tail[0], (tail[1] if len(tail) == 2 else None)


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_one_clear_line(case, assets, tmp_path, capsys, work, monkeypatch, fresh_accelerate_state):
    argv, names, out = prepare(case, assets, tmp_path)
    before = snapshot(out)
    if case.processes is not None:
        simulated_launch(monkeypatch, case.processes)

    code = main(argv)

    captured = capsys.readouterr()
    assert code == 2
    assert "Traceback" not in captured.err + captured.out
    error, hint = error_lines(captured.err)
    for needle in fill(case.needles, names):
        assert needle in error, f"{needle!r} not in {error!r}"
    if case.hint is not None:
        assert hint is not None and fill([case.hint], names)[0] in hint, hint
    assert work == [], f"{work} ran before the error"
    assert snapshot(out) == before


def test_good_config_passes_the_same_checks(assets, tmp_path, capsys, work, fresh_accelerate_state):
    """The control for the table: its base config tokenizes and reaches training, so the spies work."""
    argv, _, out = prepare(Case("good", []), assets, tmp_path)
    assert main(argv) == 0
    assert "error:" not in capsys.readouterr().err
    assert work == ["tokenize", "fit"]


def test_mismatch_hint_really_works(assets):
    """The hint's ``model.ignore_mismatched_sizes: true`` loads the 3-label checkpoint with a 2-label head."""
    from finetune.config import ModelConfig
    from finetune.modeling import load_model

    model = load_model(ModelConfig(name_or_path=assets["ckpt3"], ignore_mismatched_sizes=True), {0: "ham", 1: "spam"})
    assert model.config.num_labels == 2
    assert model.classifier.out_features == 2


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_raises_instead(how, assets, tmp_path, monkeypatch, work, fresh_accelerate_state):
    argv, _, _ = prepare(CASES_BY_ID["data-validation-label-not-in-train"], assets, tmp_path)
    if how == "flag":
        argv = ["--debug", *argv]
    else:
        monkeypatch.setenv("FINETUNE_DEBUG", "1")
    with pytest.raises(DataError, match="label 'eggs' at line 4"):
        main(argv)



def test_only_the_main_process_prints(assets, tmp_path, capsys, monkeypatch, work, fresh_accelerate_state):
    """Other ranks stay silent, and wait so that torchrun does not kill the main one before it prints."""
    import finetune.errors

    waits: list[float] = []
    monkeypatch.setattr(finetune.errors.time, "sleep", waits.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv, _, _ = prepare(CASES_BY_ID["config-max-steps-and-epochs"], assets, tmp_path)
    assert main(argv) == 2
    assert "error:" not in capsys.readouterr().err
    assert waits and waits[0] > 0


# --------------------------------------------------------------------------- as a user runs it


@pytest.mark.slow
def test_script_exits_2_with_one_line(assets, tmp_path):
    """``python finetune/train.py`` passes the exit code 2 through; the line names file, row and label."""
    argv, names, out = prepare(CASES_BY_ID["data-validation-label-not-in-train"], assets, tmp_path)
    before = snapshot(out)
    proc = run_cli(argv, launcher=[sys.executable])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    error, hint = error_lines(proc.stderr)
    assert f"{names['root']}/val.csv" in error and "label 'eggs' at line 4" in error
    assert snapshot(out) == before


@pytest.mark.slow
def test_accelerate_launch_quiet_exits_1_with_error_and_hint(assets, tmp_path):
    """Under ``accelerate launch -q`` the launcher turns 2 into 1 but adds no traceback."""
    argv, names, out = prepare(CASES_BY_ID["model-label-count-mismatch"], assets, tmp_path)
    before = snapshot(out)
    proc = run_cli(argv)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    error, hint = error_lines(proc.stderr)
    assert names["ckpt3"] in error and "3 labels" in error
    assert hint is not None and "model.ignore_mismatched_sizes" in hint
    assert snapshot(out) == before


@pytest.mark.slow
def test_debug_flag_shows_the_traceback(assets, tmp_path):
    argv, names, out = prepare(CASES_BY_ID["config-max-steps-and-epochs"], assets, tmp_path)
    proc = run_cli(["--debug", *argv], launcher=[sys.executable])
    assert proc.returncode == 1  # an uncaught exception
    assert "Traceback (most recent call last)" in proc.stderr
    assert "finetune.errors.ConfigError" in proc.stderr and "training.max_steps" in proc.stderr
    assert not any(line.startswith("error:") for line in proc.stderr.splitlines())


@pytest.mark.parametrize("case_id", ["config-unknown-key", "override-unknown-key", "config-output-dir-under-a-file",
                                     "launch-more-processes-than-batch-splits", "data-file-missing",
                                     "data-folder-missing", "model-path-missing"])
def test_first_hour_errors_are_said_before_torch_is_imported(case_id, assets, tmp_path):
    """A mistyped key or path, a folder the run must not write into or a batch the launched processes cannot
    split is said at once: importing torch and transformers, which takes seconds, waits for those checks."""
    from helpers import call_in_a_fresh_python

    argv, names, out = prepare(CASES_BY_ID[case_id], assets, tmp_path)
    # a launcher's processes are told how many they are (what torchrun sets); refused before they join
    launched = {"WORLD_SIZE": str(CASES_BY_ID[case_id].processes)} if CASES_BY_ID[case_id].processes else {}
    code, imported, stderr = call_in_a_fresh_python("finetune.train.main", argv, env=launched)
    assert (code, imported) == ("2", []), stderr[-2000:]
    error, _ = error_lines(stderr)
    assert all(fill(needle, names) in error for needle in CASES_BY_ID[case_id].needles)


# what a run imports once its data is read: transformers' scheduler module imports PEFT, which imports
# bitsandbytes where it is installed and transformers' model code
LATE_MODULES = ("peft", "bitsandbytes", "transformers.modeling_utils")


def test_data_errors_are_said_before_peft_and_the_model_code_are_imported(assets, tmp_path):
    """What a file of one's own gets wrong first (a column, empty texts, a label) is said once the file is read,
    before the imports that only training needs, seconds of them: each of these ends with its one line in a
    process that has not imported them."""
    from helpers import calls_in_a_fresh_python

    cases = ["data-text-column-missing", "data-empty-texts", "data-validation-label-not-in-train",
             "data-only-one-class"]
    runs = []
    for case_id in cases:
        (tmp_path / case_id).mkdir()
        runs.append(prepare(CASES_BY_ID[case_id], assets, tmp_path / case_id))
    codes, imported, stderr = calls_in_a_fresh_python("finetune.train.main", [[argv] for argv, _, _ in runs],
                                                      modules=LATE_MODULES, timeout=300)
    assert (codes, imported) == (["2"] * len(cases), []), stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == len(cases)
    for error, case_id, (_, names, _) in zip(errors, cases, runs):
        assert all(fill(needle, names) in error for needle in CASES_BY_ID[case_id].needles), (case_id, error)


@pytest.mark.parametrize("rank, world, printed", [
    (None, None, True), ("0", "2", True), ("1", "2", False),
    ("1", None, True),  # a RANK without a launch of several processes (a job array's): not a silent rank
])
def test_under_a_launcher_the_main_process_alone_prints_the_error(monkeypatch, capsys, rank, world, printed):
    """Every launched process meets the same bad input: one line in all, and the others wait for it to be
    printed (torchrun stops the rest as soon as one exits)."""
    import finetune.errors
    from finetune.errors import ConfigError, run_command

    waited = []
    monkeypatch.setattr(finetune.errors.time, "sleep", waited.append)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for name, value in (("RANK", rank), ("WORLD_SIZE", world)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)

    def refused():
        raise ConfigError("training.bogus: unknown key")

    assert run_command(refused) == 2
    assert capsys.readouterr().err == ("error: training.bogus: unknown key\n" if printed else "")
    assert bool(waited) is not printed


def test_ctrl_c_outside_a_runs_handler_is_one_line_and_the_shells_code_for_sigint():
    """Ctrl-C while a run loads its data or model (before training, where finetune.signals takes it) or while a
    file is predicted: one line and 130, in a real process sent SIGINT; ``FINETUNE_DEBUG`` keeps the traceback."""
    import signal as signals

    program = ("import sys, time\n"
               "from finetune.errors import run_command\n"
               "def work():\n"
               "    print('ready', flush=True)\n"
               "    time.sleep(60)\n"
               "sys.exit(run_command(work))\n")
    for debug in ("0", "1"):
        # Ctrl-C's default, as a terminal's foreground command has it: a suite run in the background of a shell
        # would pass SIGINT down ignored, and Python installs no KeyboardInterrupt for an ignored signal
        child = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, "FINETUNE_DEBUG": debug},
                                 preexec_fn=lambda: signals.signal(signals.SIGINT, signals.SIG_DFL))
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signals.SIGINT)
        _, err = child.communicate(timeout=60)
        if debug == "0":
            assert (child.returncode, err) == (130, "error: interrupted by SIGINT (Ctrl-C)\n")
        else:
            assert child.returncode == -signals.SIGINT and err.startswith("Traceback") and "KeyboardInterrupt" in err


@pytest.mark.parametrize("command", ["train", "sweep"])
@pytest.mark.parametrize("rank, world", [(None, None), ("1", "2")])
def test_the_log_holds_the_packages_lines_and_other_libraries_warnings(command, rank, world):
    """A library's INFO (an HTTP request for each file fetched from the Hub) stays out of a run's log, its warnings
    do not; the package's own lines are on the process that speaks: ``finetune train`` and ``finetune sweep``
    each set their log up so, in a real process (pytest's own logging would hide how the root logger is set)."""
    program = (f"import logging, sys\n"
               f"import finetune.{command} as {command}\n"
               f"{command}.build_sweep = lambda *args: None\n"
               f"def run(*args, **kwargs):\n"
               f"    for name in ('httpx', 'matplotlib.font_manager', 'finetune', 'finetune.data'):\n"
               f"        logging.getLogger(name).info('info from %s', name)\n"
               f"        logging.getLogger(name).warning('warning from %s', name)\n"
               f"    return 0\n"
               f"{command}.{'run_training' if command == 'train' else 'run_sweep'} = run\n"
               f"{command}.main({['--sweep', 'any.yaml'] if command == 'sweep' else []!r})\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update({"RANK": rank, "WORLD_SIZE": world} if rank else {})
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120)
    said = [line.split(" ", 2)[2] for line in done.stderr.splitlines() if " from " in line]
    speaks = rank is None
    assert said == [
        "WARNING httpx: warning from httpx", "WARNING matplotlib.font_manager: warning from matplotlib.font_manager",
        *(["INFO finetune: info from finetune"] if speaks else []), "WARNING finetune: warning from finetune",
        *(["INFO finetune.data: info from finetune.data"] if speaks else []),
        "WARNING finetune.data: warning from finetune.data"], done.stderr


@pytest.mark.parametrize("argv, said", [
    (["predict", "out", "great fun", "--batch-size", "abc"], "argument --batch-size: invalid int value: 'abc'"),
    (["score", "out", "--file", "held_out.csv", "--batch-size", "0.5"], "argument --batch-size: invalid int value: '0.5'"),
    (["score", "out"], "the following arguments are required: --file"),
    (["sweep", "--trials", "many"], "argument --trials: invalid int value: 'many'"),
    (["plot"], "the following arguments are required: output_dir"),
])
def test_an_option_of_the_wrong_type_is_one_line_and_a_hint(argv, said, capsys):
    """argparse would print its usage block before its error; each command says the error and where its options
    are listed instead, with argparse's exit code."""
    from finetune.cli import main as finetune

    with pytest.raises(SystemExit) as done:
        finetune(argv)
    assert done.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {said}",
                                                    f"hint: finetune {argv[0]} --help lists its options"]
