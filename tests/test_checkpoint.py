"""Checkpoints, exact resume, SIGTERM / SIGINT / SIGKILL, and the non-finite stop.

The end-to-end tests run ``tests/interrupt_worker.py`` (``finetune/train.py``
with a signal, a SIGKILL or a NaN injected at a chosen update) on a tiny BERT
with dropout on and ``k = 3``, resume with ``output.resume_from=latest``, and
require the final weights to be bitwise those of the uninterrupted run. A SIGTERM mid-epoch, resumed by
the same command again, is in ``test_never_lose_a_run.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from finetune.accumulation import Batching
from finetune.checkpoint_files import STATE_FILE, list_checkpoints, resolve_resume
from finetune.resuming import check_compatible, run_fingerprint
from finetune.config import config_from_dict
from finetune.errors import ConfigError
from finetune.optimization import plan_updates
from finetune.outputs import clear_previous_run
from finetune.output_dir import check_output_dir
from finetune.signals import StopSignals, resume_command
import forked
from helpers import REPO, make_texts, offline_env, save_tiny_model, wandb_offline_starts, write_tsv

WORKER = REPO / "tests" / "interrupt_worker.py"
# per-update throughput differs between runs; everything else in a record must not
TIMING_KEYS = {"train/samples_per_s", "train/tokens_per_s"}


# --------------------------------------------------------------------------- unit level

def _fake_checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"format": 1, "state": {"step": step}}), encoding="utf-8")
    return path


def test_only_complete_checkpoints_are_found(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root / "checkpoint-2", 2)
    _fake_checkpoint(root / "checkpoint-10", 10)
    _fake_checkpoint(root / ".tmp-checkpoint-14", 14)  # a save cut short before its rename
    (root / "checkpoint-12").mkdir()  # no trainer_state.json: not complete
    (root / "checkpoint-13").mkdir()
    (root / "checkpoint-13" / STATE_FILE).write_text('{"format": 1, "sta', encoding="utf-8")  # cut short
    _fake_checkpoint(root / ".old-checkpoint-10", 10)  # the copy being replaced: checkpoint-10 wins
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-10"]
    assert resolve_resume(tmp_path, "latest") == root / "checkpoint-10"
    # killed between the two renames of a re-save: the previous copy is still found
    _fake_checkpoint(root / ".old-checkpoint-16", 16)
    assert resolve_resume(tmp_path, "latest") == root / ".old-checkpoint-16"
    assert resolve_resume(tmp_path, str(root / "checkpoint-2")) == root / "checkpoint-2"
    assert resolve_resume(tmp_path, None) is None
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        resolve_resume(tmp_path, str(root / "checkpoint-12"))
    with pytest.raises(ConfigError, match="is not a directory"):
        resolve_resume(tmp_path, str(root / "checkpoint-99"))


def _cfg(out: Path, **output):
    return config_from_dict({"data": {"train_file": "x.tsv"}, "output": {"output_dir": str(out), **output}})


def test_output_dir_rules_refuse_before_touching_anything(tmp_path):
    out = tmp_path / "out"
    check_output_dir(_cfg(out))  # missing: fine
    out.mkdir()
    (out / "train_log.jsonl").write_text('{"step": 1}\n', encoding="utf-8")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # the default, auto, resumes only from a checkpoint: an earlier run's files alone are not replaced
    with pytest.raises(ConfigError, match="output.output_dir: .* holds an earlier run's files but no checkpoint "
                                          "to resume from; pass output.overwrite=true"):
        check_output_dir(_cfg(out))
    with pytest.raises(ConfigError, match="output.output_dir: .* is not empty"):
        check_output_dir(_cfg(out, resume_from=None))
    with pytest.raises(ConfigError, match="output.resume_from: latest, but .* holds no complete checkpoint"):
        check_output_dir(_cfg(out, resume_from="latest"))
    check_output_dir(_cfg(out, overwrite=True))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_pruning_removes_old_checkpoints_and_cut_saves_and_nothing_else(tmp_path):
    from finetune.checkpoint_files import prune

    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        _fake_checkpoint(root / f"checkpoint-{step}", step)
    _fake_checkpoint(root / ".tmp-checkpoint-8", 8)  # a save a kill cut short
    (root / "best-by-hand").mkdir()  # a user's copy, and a user's file
    (root / "best-by-hand" / "model.safetensors").write_text("mine", encoding="utf-8")
    (root / "notes.md").write_text("mine", encoding="utf-8")
    prune(root, keep_last=1, keep=set())
    assert sorted(p.name for p in root.iterdir()) == ["best-by-hand", "checkpoint-6", "notes.md"]
    assert (root / "best-by-hand" / "model.safetensors").read_text(encoding="utf-8") == "mine"


def test_overwrite_clears_the_earlier_runs_state_only(tmp_path):
    _fake_checkpoint(tmp_path / "checkpoints" / "checkpoint-4", 4)
    _fake_checkpoint(tmp_path / "checkpoints" / ".tmp-checkpoint-6", 6)
    (tmp_path / "checkpoints" / "best-by-hand").mkdir()  # a user's copy: not finetune's to delete
    (tmp_path / "checkpoints" / "checkpoint-1").mkdir()  # named like one, but not written by finetune
    (tmp_path / "checkpoints" / "notes.md").write_text("mine", encoding="utf-8")
    for name in ("train_log.jsonl", "metrics.json", "all_results.json", "curves.png", "model.safetensors",
                 "notes.txt", "README.md"):  # a README.md without the card's mark: the user's
        (tmp_path / name).write_text("x", encoding="utf-8")
    (tmp_path / "adapter").mkdir()  # no adapter_config.json: not a LoRA run's adapter
    (tmp_path / "adapter" / "plan.txt").write_text("mine", encoding="utf-8")
    removed = clear_previous_run(tmp_path)
    assert sorted(p.name for p in removed) == [".tmp-checkpoint-6", "all_results.json", "checkpoint-4", "curves.png",
                                               "metrics.json", "train_log.jsonl"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "adapter", "checkpoints", "model.safetensors",
                                                          "notes.txt"]
    assert (tmp_path / "adapter" / "plan.txt").read_text(encoding="utf-8") == "mine"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["best-by-hand", "checkpoint-1", "notes.md"]
    # a checkpoints folder that held only checkpoints goes with them
    _fake_checkpoint(tmp_path / "again" / "checkpoints" / "checkpoint-2", 2)
    clear_previous_run(tmp_path / "again")
    assert not (tmp_path / "again" / "checkpoints").exists()


def _fake_run(cfg, processes=1, samples=48, precision="no", device="cpu", labels=("ham", "spam")):
    from accelerate.utils import DistributedType

    from finetune.accumulation import resolve_batching
    from finetune.autobatch import Checkpointing

    batching = resolve_batching(cfg.training, processes)
    micro = -(-samples // (batching.per_device_batch_size * processes))
    plan = plan_updates(micro, batching.gradient_accumulation_steps, cfg.training.num_train_epochs,
                        cfg.training.max_steps)
    accelerator = SimpleNamespace(mixed_precision=precision, distributed_type=DistributedType.NO,
                                  device=torch.device(device), num_processes=processes)
    return SimpleNamespace(cfg=cfg, batching=batching, plan=plan, accelerator=accelerator,
                           checkpointing=Checkpointing(), train_dataloader=SimpleNamespace(dataset=range(samples)),
                           labels=SimpleNamespace(names=list(labels)))


def test_a_resume_under_other_settings_is_refused(tmp_path):
    base = {"data": {"train_file": "x.tsv"},
            "training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "num_train_epochs": 2}}
    saved = {"fingerprint": run_fingerprint(_fake_run(config_from_dict(base)))}
    path = tmp_path / "checkpoint-3"

    def variant(**training):
        return _fake_run(config_from_dict({**base, "training": {**base["training"], **training}}))

    # harmless changes resume; the same k written as an effective batch too
    check_compatible(saved, variant(on_nonfinite="skip", max_skipped=3, eval_each_epoch=False), path)
    check_compatible(saved, variant(gradient_accumulation_steps=None, effective_batch_size=12), path)
    with pytest.raises(ConfigError, match=r"settings: training.num_train_epochs: 2.0 -> 3.0; .*plan.total_updates: 8 -> 12"):
        check_compatible(saved, variant(num_train_epochs=3), path)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: 3 -> 6"):
        check_compatible(saved, variant(gradient_accumulation_steps=None, effective_batch_size=24), path)
    # the label ids in another order (a trained head the run starts from, whose order they take, changed under
    # the same model id): each output would go on as another class
    with pytest.raises(ConfigError, match=r"labels: \['ham', 'spam'\] -> \['spam', 'ham'\]"):
        check_compatible(saved, _fake_run(config_from_dict(base), labels=("spam", "ham")), path)
    with pytest.raises(ConfigError, match="processes: 1 -> 2"):
        check_compatible(saved, _fake_run(config_from_dict(
            {**base, "training": {**base["training"], "gradient_accumulation_steps": None,
                                  "effective_batch_size": 24}}), processes=2), path)
    # the same B split otherwise (b=2, k=3, P=2): the same run, on other processes (finetune.resplit)
    check_compatible(saved, _fake_run(config_from_dict(
        {**base, "training": {**base["training"], "per_device_train_batch_size": 2, "gradient_accumulation_steps": None,
                              "effective_batch_size": 12}}), processes=2), path)
    # mixed_precision: auto on a machine that computes bf16 is not the fp32 run the checkpoint was on (one
    # requeued onto another kind of machine), and the refusal names the setting that resumes it there
    with pytest.raises(ConfigError, match="chose otherwise on the machine that wrote it .precision: 'no' -> "
                                          "'bf16'") as refused:
        check_compatible(saved, _fake_run(config_from_dict(base), precision="bf16"), path)
    assert refused.value.hint == "the same command with training.mixed_precision=no resumes it"
    check_compatible(saved, variant(mixed_precision="no"), path)  # ... which it does: compared as applied
    # requeued onto two processes of another kind, the same B split otherwise: the same hint
    resplit = {**base["training"], "per_device_train_batch_size": 2, "gradient_accumulation_steps": None,
               "effective_batch_size": 12}
    with pytest.raises(ConfigError, match="chose otherwise") as refused:
        check_compatible(saved, _fake_run(config_from_dict({**base, "training": resplit}), processes=2,
                                          precision="bf16"), path)
    assert refused.value.hint == "the same command with training.mixed_precision=no resumes it"
    # a precision asked for by name is the user's change: refused, with nothing to suggest
    with pytest.raises(ConfigError, match="other settings: precision: 'no' -> 'bf16'") as refused:
        check_compatible(saved, _fake_run(config_from_dict(
            {**base, "training": {**base["training"], "mixed_precision": "bf16"}}), precision="bf16"), path)
    assert refused.value.hint is None
    # nor where the precision is not all that changed
    with pytest.raises(ConfigError, match="other settings: training.num_train_epochs") as refused:
        check_compatible(saved, _fake_run(config_from_dict(
            {**base, "training": {**base["training"], "num_train_epochs": 3}}), precision="bf16"), path)
    assert refused.value.hint is None
    # a checkpoint written before the fingerprint named the precision still resumes, and is compared with the
    # precision its config named
    older = {"fingerprint": {k: v for k, v in saved["fingerprint"].items() if k != "precision"}}
    check_compatible(older, variant(), path)
    older_fp32 = {"fingerprint": {**older["fingerprint"], "training.mixed_precision": "no"}}
    check_compatible(older_fp32, variant(mixed_precision="no"), path)
    with pytest.raises(ConfigError, match="precision: 'no' -> 'bf16'"):
        check_compatible(older_fp32, _fake_run(config_from_dict(
            {**base, "training": {**base["training"], "mixed_precision": "bf16"}}), precision="bf16"), path)
    # and one whose fingerprint held b as a config key, before another split of B could resume
    assert "training.per_device_train_batch_size" not in saved["fingerprint"]
    with_b = {"fingerprint": {**saved["fingerprint"], "training.per_device_train_batch_size": 4}}
    check_compatible(with_b, variant(), path)
    assert Batching(4, 3, 1).effective_batch_size == 12


def test_a_folder_whose_run_another_machine_decided_names_the_setting_that_resumes_it(tmp_path):
    """A run requeued onto another kind of machine finds checkpoints that ``auto`` decided otherwise for (bf16
    where this machine trains fp32): the folder is the same run, and the refusal says how to resume it rather
    than to overwrite it."""
    from finetune.resuming import choose_checkpoint

    base = {"data": {"train_file": "x.tsv"}, "output": {"output_dir": str(tmp_path)},
            "training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3}}
    path = _fake_checkpoint(tmp_path / "checkpoints" / "checkpoint-2", 2)
    state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    state["fingerprint"] = run_fingerprint(_fake_run(config_from_dict(base), precision="bf16"))
    (path / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")

    with pytest.raises(ConfigError, match=f"output.output_dir: {tmp_path} holds a run whose `auto` settings chose "
                                          "otherwise .*precision: 'bf16' -> 'no'") as refused:
        choose_checkpoint(_fake_run(config_from_dict(base), precision="no"))
    assert refused.value.hint == "the same command with training.mixed_precision=bf16 resumes it"
    bf16 = {**base, "training": {**base["training"], "mixed_precision": "bf16"}}
    assert choose_checkpoint(_fake_run(config_from_dict(bf16), precision="bf16")) == path
    # another run's folder is still refused as such
    longer = {**base, "training": {**base["training"], "num_train_epochs": 2}}
    with pytest.raises(ConfigError, match="holds checkpoints of another run") as refused:
        choose_checkpoint(_fake_run(config_from_dict(longer), precision="no"))
    assert refused.value.hint is None


def test_a_run_resumes_whatever_process_count_and_cache_made_its_tokens(tmp_path):
    """``data.tokenize_processes``, ``data.cache_tokenized`` and ``data.cache_dir`` change where and how fast the
    tokens are made, not what they are: a run requeued with other values (a machine of other cores, a cache
    elsewhere) resumes, and so does a checkpoint of a release whose fingerprint still held the last two."""
    path = tmp_path / "checkpoint-3"

    def run(**data):
        cfg = config_from_dict({"data": {"train_file": "x.tsv", **data},
                                "training": {"per_device_train_batch_size": 4}})
        return _fake_run(cfg)

    saved = {"fingerprint": run_fingerprint(run(tokenize_processes=2, cache_dir=str(tmp_path / "tokens")))}
    assert not any(key in saved["fingerprint"] for key in ("data.tokenize_processes", "data.cache_dir",
                                                           "data.cache_tokenized"))
    check_compatible(saved, run(), path)
    check_compatible(saved, run(tokenize_processes=8, cache_tokenized=False), path)
    older = {"fingerprint": {**saved["fingerprint"], "data.cache_tokenized": True, "data.cache_dir": "/elsewhere"}}
    check_compatible(older, run(cache_dir=str(tmp_path)), path)
    with pytest.raises(ConfigError, match="written by a run with other settings: data.max_length: 128 -> 64;"):
        check_compatible(saved, run(max_length=64), path)  # what the tokens are is still compared


def test_a_validation_share_the_carve_raised_is_compared_once_setup_has_carved(tmp_path):
    """A carve raises ``data.validation_split`` where the share asked for holds fewer rows than the classes, and
    writes the share it held out into the run's config: the command that started the run asked for less, so the
    check made before anything is loaded leaves the key to the check made once the data is carved again."""
    from finetune.resuming import config_changes

    path = tmp_path / "checkpoint-3"

    def cfg(split, max_length=128):
        return config_from_dict({"data": {"train_file": "x.tsv", "validation_split": split, "max_length": max_length},
                                 "training": {"per_device_train_batch_size": 4}})

    saved = {"fingerprint": run_fingerprint(_fake_run(cfg(1 / 3)))}
    assert config_changes(saved, cfg(0.1)) is None
    assert config_changes(saved, cfg(0.1, max_length=64)) == "data.max_length: 128 -> 64"
    check_compatible(saved, _fake_run(cfg(1 / 3)), path)  # the command's 0.1, once the carve has raised it
    with pytest.raises(ConfigError, match=r"other settings: data.validation_split: 0.333\d* -> 0.5"):
        check_compatible(saved, _fake_run(cfg(0.5)), path)


def test_cuda_graphs_resume_as_applied_whatever_the_spelling(tmp_path):
    """Graphs pad micro-batches to other shapes, which draw other dropout masks: a checkpoint resumes only
    where graphs are applied as they were. ``auto`` resumes what ``false`` wrote wherever both mean eager."""
    path = tmp_path / "checkpoint-3"

    def run(cuda_graphs, device="cpu", precision="bf16"):
        cfg = config_from_dict({"data": {"train_file": "x.tsv"},
                                "training": {"per_device_train_batch_size": 4, "cuda_graphs": cuda_graphs}})
        return _fake_run(cfg, device=device, precision=precision)

    saved = {"fingerprint": run_fingerprint(run(False, "cuda"))}
    assert saved["fingerprint"]["cuda_graphs"] is False
    fp32 = {"fingerprint": run_fingerprint(run(False, "cuda", precision="no"))}
    check_compatible(fp32, run("auto", "cuda", precision="no"), path)  # auto leaves fp32 eager
    with pytest.raises(ConfigError, match="chose otherwise on the machine that wrote it .cuda_graphs: False -> "
                                          r"True\)$") as refused:
        check_compatible(saved, run("auto", "cuda"), path)
    assert refused.value.hint == "the same command with training.cuda_graphs=false resumes it"
    check_compatible(saved, run(False, "cuda"), path)
    check_compatible({"fingerprint": run_fingerprint(run(True, "cuda"))}, run("auto", "cuda"), path)
    # graphs applied on a GPU cannot be on a CPU: nothing resumes that checkpoint there
    with pytest.raises(ConfigError, match="other settings: cuda_graphs: True -> False") as refused:
        check_compatible({"fingerprint": run_fingerprint(run(True, "cuda"))}, run("auto"), path)
    assert refused.value.hint is None

    # checkpoints written before auto, which compared the setting as spelled
    def older(cuda_graphs, device="cpu"):
        fingerprint = {k: v for k, v in run_fingerprint(run(cuda_graphs, device)).items() if k != "cuda_graphs"}
        return {"fingerprint": {**fingerprint, "training.cuda_graphs": cuda_graphs}}

    check_compatible(older(False), run("auto"), path)  # eager on a CPU, before and after
    check_compatible(older(True), run("auto"), path)  # true on a CPU trained eagerly
    check_compatible(older(True, "cuda"), run("auto", "cuda"), path)
    with pytest.raises(ConfigError, match=r"otherwise on the machine that wrote it .cuda_graphs: False -> True\)$"):
        check_compatible(older(False, "cuda"), run("auto", "cuda"), path)


def test_first_signal_is_recorded_and_handlers_restored():
    previous = signal.getsignal(signal.SIGTERM)
    with StopSignals() as stop:
        assert stop.signum is None
        os.kill(os.getpid(), signal.SIGTERM)  # would end pytest without the handler
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is previous


def test_nested_scopes_share_a_signal_in_both_directions():
    with StopSignals() as outer:
        os.kill(os.getpid(), signal.SIGTERM)  # before the inner scope: a sweep's trial still loading
        with StopSignals() as inner:
            assert inner.signum == signal.SIGTERM  # so its training stops at the first window boundary
        assert outer.signum == signal.SIGTERM
    with StopSignals() as outer:
        with StopSignals() as inner:
            assert inner.signum is None
            os.kill(os.getpid(), signal.SIGINT)
            assert (inner.signum, outer.signum) == (signal.SIGINT, None)
        assert outer.signum == signal.SIGINT  # the enclosing scope learns of it when the inner one ends


def test_resume_command_repeats_the_arguments(monkeypatch):
    for name in ("ACCELERATE_USE_CPU", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    argv = ["finetune/train.py", "--config", "my run.yaml", "output.resume_from=old", "training.seed=3"]
    assert resume_command(1, argv) == (
        "python finetune/train.py --config 'my run.yaml' training.seed=3 output.resume_from=latest"
    )
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resume_command(2, argv).startswith("accelerate launch --multi_gpu --num_processes 2 finetune/train.py ")
    monkeypatch.delenv("LOCAL_RANK")
    installed = ["/venv/bin/finetune", "train", "--data", "a b.csv", "output.resume_from=x"]
    assert resume_command(1, installed) == "finetune train --data 'a b.csv' output.resume_from=latest"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resume_command(4, ["/x/finetune/cli.py", "train", "--data", "r.csv"]) == (
        "accelerate launch --multi_gpu --num_processes 4 -m finetune.cli train --data r.csv output.resume_from=latest")
    monkeypatch.delenv("LOCAL_RANK")
    # a sweep's trial: the sweep's own command, which goes on where it stopped, its trial from its checkpoint
    sweep = ["--sweep", "configs/sweeps/default.yaml", "--data", "a b.csv", "optim.learning_rate=1e-4"]
    assert resume_command(1, ["/venv/bin/finetune", "sweep", *sweep]) == (
        "finetune sweep --sweep configs/sweeps/default.yaml --data 'a b.csv' optim.learning_rate=1e-4")
    assert resume_command(1, ["/x/finetune/cli.py", "sweep", *sweep]).startswith(
        "python -m finetune.cli sweep --sweep configs/sweeps/default.yaml")
    assert resume_command(1, ["/venv/bin/finetune-sweep", *sweep]).startswith("finetune-sweep --sweep ")
    assert resume_command(1, ["/x/finetune/sweep.py", *sweep]).startswith("python -m finetune.sweep --sweep ")


def test_log_records_fall_on_the_same_steps_after_a_mid_epoch_resume(fresh_accelerate_state):
    """``log_every`` counts windows of the epoch, not of the call: a resumed call logs where the whole one did."""
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from finetune.loop import TrainState, train_one_epoch
    from helpers import pad_collate, tiny_bert, token_dataset

    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    data = token_dataset(24, seed=4)  # b=2, k=2: 12 micro-batches, 6 windows
    model = tiny_bert(seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dl = DataLoader(data, batch_size=2, collate_fn=pad_collate)
    model, optimizer, dl = acc.prepare(model, optimizer, dl)

    def steps(stop_after=None):
        records, state = [], TrainState()
        train_one_epoch(model, optimizer, None, dl, acc, 0, state=state, log_every=2, on_log=records.append,
                        on_update=lambda s: s.step == stop_after)
        if stop_after is not None:
            assert state.micro_batch == 2 * stop_after  # stopped at a window boundary: resume from there
            train_one_epoch(model, optimizer, None, dl, acc, 0, state=state, log_every=2, on_log=records.append)
        return [r["step"] for r in records]

    assert steps() == [2, 4, 6]
    assert steps(stop_after=3) == [2, 4, 6]


# --------------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = save_tiny_model(root / "tiny-bert")
    data = write_tsv(root / "sms.tsv", make_texts(60, seed=3))
    cfg = {
        "model": {"name_or_path": str(model), "dropout": 0.1},  # dropout on: the RNG restore is tested
        "data": {"train_file": str(data), "format": "tsv", "has_header": False, "column_names": ["label", "text"],
                 "validation_split": 0.2, "max_length": 32},
        # 48 training rows, b=4: 12 micro-batches, k=3: 4 updates per epoch, 8 in all
        "training": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 3, "num_train_epochs": 2,
                     "seed": 1, "mixed_precision": "no"},
        "optim": {"learning_rate": 1e-3, "warmup_steps": 1},
        "evaluation": {"metrics": ["accuracy"], "average": "macro"},
        "logging": {"progress_bar": False},
        "output": {"checkpoint_every": 2, "keep_last": 2},
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return root, path


def _train(cfg: Path, out: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    # no launcher: the process's own exit code comes through (accelerate launch turns it into 1)
    return forked.run([sys.executable, str(WORKER), "--config", str(cfg), f"output.output_dir={out}", *overrides],
                      env=offline_env({"FINETUNE_CPU_THREADS": "1", **env}), timeout=240)


@pytest.fixture(scope="module")
def reference(setup):
    root, cfg = setup
    out = root / "reference"
    proc = _train(cfg, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _records(out: Path) -> list[dict]:
    lines = (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS} for line in lines]


def _assert_same_run(out: Path, reference: Path) -> None:
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert _records(out) == _records(reference)  # no duplicate, no missing record
    metrics, expected = (json.loads((d / "metrics.json").read_text()) for d in (out, reference))
    for m in (metrics, expected):
        m["train"].pop("seconds")
        m["memory_plan"].pop("available")  # the machine's free memory at each start
    assert metrics == expected


def _state(checkpoint: Path) -> dict:
    return json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))


@pytest.mark.slow
def test_reference_run_checkpoints(reference):
    # every 2 updates and at each epoch end (4, 8); keep_last=2
    assert [p.name for p in list_checkpoints(reference)] == ["checkpoint-6", "checkpoint-8"]
    assert not list((reference / "checkpoints").glob(".*"))
    meta = _state(reference / "checkpoints" / "checkpoint-6")
    assert meta["state"]["epoch"] == 1 and meta["state"]["micro_batch"] == 6  # mid-epoch, window boundary
    assert [r["step"] for r in meta["history"]] == [4]  # the first epoch's evaluation
    files = {p.name for p in (reference / "checkpoints" / "checkpoint-6").iterdir()}
    # transformers 4.x's tokenizers also write their vocabulary and special tokens as files of their own
    files -= {"vocab.txt", "special_tokens_map.json"}
    assert files == {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.pt", STATE_FILE,
                     "manifest.json",  # every other file's size and SHA-256
                     # and what makes it a model: transformers' config, the tokenizer, the run's config
                     "config.json", "tokenizer.json", "tokenizer_config.json", "config.yaml"}


@pytest.mark.slow
def test_sigint_at_epoch_end_then_resume_is_exact(setup, reference):
    root, cfg = setup
    out = root / "sigint"
    proc = _train(cfg, out, FINETUNE_TEST_SIGNAL="4:SIGINT")
    assert proc.returncode == 130, proc.stderr[-3000:]
    meta = _state(out / "checkpoints" / "checkpoint-4")
    # the epoch's last update: saved at once, its evaluation left for the resumed run
    assert (meta["state"]["epoch"], meta["state"]["micro_batch"], meta["pending_eval_epoch"]) == (1, 0, 0)
    assert not [r for r in _records(out) if "eval/loss" in r]

    proc = _train(cfg, out, "output.resume_from=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_same_run(out, reference)


@pytest.mark.slow
def test_sigkill_while_saving_resumes_from_the_previous_checkpoint(setup, reference):
    root, cfg = setup
    out = root / "sigkill"
    proc = _train(cfg, out, FINETUNE_TEST_KILL_SAVING="6")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (out / "checkpoints" / ".tmp-checkpoint-6").is_dir()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]
    assert [r["step"] for r in _records(out) if "train/loss" in r][-1] == 6  # the log ran ahead of the checkpoint

    proc = _train(cfg, out, "output.resume_from=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-4: update 4, epoch 1, micro-batch 0" in proc.stderr
    _assert_same_run(out, reference)
    assert not list((out / "checkpoints").glob(".*"))  # the leftover was cleaned up


TRACKERS = "logging.report_to=[tensorboard,wandb,mlflow]"


def _tracker_env(root: Path) -> dict[str, str]:
    """W&B offline into ``root``, MLflow into a SQLite file there: each tracker's own files, read back below."""
    (root / "wandb").mkdir(exist_ok=True)
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(root / "wandb"), "WANDB_SILENT": "true",
            "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}


def _tensorboard_steps(out: Path) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "finetune"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def _assert_same_curve(shown: list[tuple[int, float]], logged: list[tuple[int, float]]) -> None:
    """The same updates, the same losses (a tracker may keep them in float32)."""
    assert [step for step, _ in shown] == [step for step, _ in logged]
    assert [value for _, value in shown] == pytest.approx([value for _, value in logged], rel=1e-6)


def _mlflow_client(root: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")


def _mlflow_runs(root: Path) -> dict[str, SimpleNamespace]:
    """Each MLflow run of the project, by id: its name, tags and updates' losses."""
    with warnings.catch_warnings():  # MLflow's store uses a loader option the newest SQLAlchemy deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        client = _mlflow_client(root)
        experiment = client.get_experiment_by_name("finetune")
        return {run.info.run_id: SimpleNamespace(name=run.info.run_name, tags=run.data.tags, steps=[
                    (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")])
                for run in client.search_runs([experiment.experiment_id])}


def _mlflow_experiment_tags(root: Path) -> dict[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _mlflow_client(root).get_experiment_by_name("finetune").tags


@pytest.mark.slow
def test_a_resumed_run_goes_on_with_its_tracker_runs_and_shows_each_update_once(setup):
    """Killed while saving update 6 and resumed at 4: TensorBoard drops the stopped run's 5 and 6; MLflow goes on
    with the stopped run's MLflow run, which has 5 and 6 already, W&B with its W&B run. Each update is shown once,
    as ``train_log.jsonl`` has it. A fresh run in the folder starts new tracker runs, named and grouped as set."""
    root, cfg = setup
    out, env = root / "trackers", _tracker_env(root)
    proc = _train(cfg, out, TRACKERS, FINETUNE_TEST_KILL_SAVING="6", **env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    runs = json.loads((out / "trackers.json").read_text())
    assert set(runs) == {"wandb", "mlflow"}
    # resumed with a key that differs: MLflow refuses a parameter logged again with another value
    proc = _train(cfg, out, TRACKERS, "output.resume_from=latest", **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "checkpoint-4: update 4, epoch 1, micro-batch 0" in proc.stderr
    assert json.loads((out / "trackers.json").read_text()) == runs
    logged = [(r["step"], r["train/loss"]) for r in _records(out) if "train/loss" in r]
    assert [step for step, _ in logged] == list(range(1, 9))

    mlflow = _mlflow_runs(root)
    assert list(mlflow) == [runs["mlflow"]]  # one MLflow run
    assert mlflow[runs["mlflow"]].name == str(out)  # named for the output folder, as the Trainer names it
    for shown in (_tensorboard_steps(out), mlflow[runs["mlflow"]].steps):
        _assert_same_curve(shown, logged)  # 5 and 6 once, not twice
    # one W&B run, started twice (the killed start holds what W&B wrote before the kill); offline, W&B counts
    # nothing of what its run holds, so the resumed start sends every update from the checkpoint on (online, its
    # server's count leaves out those it has)
    _, resumed = wandb_offline_starts(root / "wandb", runs["wandb"])
    _assert_same_curve(resumed.steps, logged[4:])

    # a fresh run in the folder (output.overwrite) starts new tracker runs, and TensorBoard shows it alone
    proc = _train(cfg, out, TRACKERS, "output.overwrite=true", "optim.learning_rate=3e-4", "logging.run_name=lr3e-4",
                  "logging.run_group=lr", **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = json.loads((out / "trackers.json").read_text())
    assert fresh["wandb"] != runs["wandb"] and fresh["mlflow"] != runs["mlflow"]
    logged = [(r["step"], r["train/loss"]) for r in _records(out) if "train/loss" in r]
    assert [step for step, _ in logged] == list(range(1, 9))
    (wandb,), mlflow = wandb_offline_starts(root / "wandb", fresh["wandb"]), _mlflow_runs(root)[fresh["mlflow"]]
    assert wandb.name == mlflow.name == "lr3e-4"
    assert wandb.group == mlflow.tags["group"] == "lr"
    assert "group" not in _mlflow_experiment_tags(root)  # the run's tag, not the experiment's
    for shown in (_tensorboard_steps(out), mlflow.steps, wandb.steps):
        _assert_same_curve(shown, logged)


@pytest.mark.slow
def test_nonfinite_stop_keeps_the_last_good_checkpoint(setup, reference):
    root, cfg = setup
    out = root / "nan"
    shutil.copytree(reference, out)  # an earlier run's checkpoints, log and metrics: overwrite must drop them
    # forward pass 7 is micro-batch 7 of epoch 0, in the window of update 3
    proc = _train(cfg, out, "output.overwrite=true", "output.checkpoint_every=1", FINETUNE_TEST_NAN_AT="7")
    assert proc.returncode == 3, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "non-finite loss (nan) at update 3" in lines[0] and "micro-batch 7" in lines[0]
    assert f"last good checkpoint: {out / 'checkpoints' / 'checkpoint-2'}" in lines[0]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert [r["step"] for r in _records(out)] == [1, 2]
    assert not (out / "metrics.json").exists()


@pytest.mark.slow
def test_two_processes_stop_together_when_one_is_signalled(setup):
    """SIGTERM reaches rank 1 only: the all-reduced flag stops rank 0 after the same update."""
    from helpers import free_port

    root, cfg = setup
    out = root / "ddp"
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                "--num_machines", "1", "--main_process_port", str(free_port()), "--mixed_precision", "no",
                "--dynamo_backend", "no", str(WORKER), "--config", str(cfg), f"output.output_dir={out}",
                "training.per_device_train_batch_size=2"]  # b=2, k=3, P=2: the same 4 updates per epoch
    env = offline_env({"FINETUNE_CPU_THREADS": "1", "FINETUNE_TEST_SIGNAL": "3:SIGTERM",
                       "FINETUNE_TEST_SIGNAL_RANK": "1"})
    proc = forked.run(launcher, env=env, timeout=240)
    assert proc.returncode != 0
    assert "interrupted by SIGTERM after update 3 (epoch 0, micro-batch 9)" in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-3"]
    files = {p.name for p in (out / "checkpoints" / "checkpoint-3").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= files
    assert [r["step"] for r in _records(out)] == [1, 2, 3]

    env.pop("FINETUNE_TEST_SIGNAL")
    launcher[launcher.index("--main_process_port") + 1] = str(free_port())
    proc = forked.run(launcher + ["output.resume_from=latest"], env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in _records(out) if "train/loss" in r] == list(range(1, 9))
    assert json.loads((out / "metrics.json").read_text())["train"]["updates"] == 8


def test_a_checkpoint_of_an_interrupted_run_is_a_model(tmp_path, capsys):
    """``from_pretrained``, ``pipeline`` and ``finetune predict`` load a checkpoint directory."""
    import torch
    from transformers import AutoModelForSequenceClassification, pipeline

    from finetune.predict import Predictor, main
    from tiny_run import fit_tiny_run

    runs = []
    cfg, summary = fit_tiny_run(tmp_path, before_fit=runs.append, on_update=lambda state: state.step >= 2,
                                output={"checkpoint_every": 2})
    run = runs[0]
    weights = run.accelerator.unwrap_model(run.model).state_dict()  # stopped right after update 2
    assert summary["train"]["ended"] == "stopped_by_caller" and not (tmp_path / "out" / "model.safetensors").exists()
    checkpoint = tmp_path / "out" / "checkpoints" / "checkpoint-2"
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert model.config.id2label == {0: "ham", 1: "spam"}
    texts = ["win a free prize now", "see you at lunch"]
    predictor = Predictor.load(checkpoint, device="cpu")
    assert predictor.max_length == cfg.data.max_length  # the run's config came with it
    expected = predictor.predict(texts)
    from_pipeline = pipeline("text-classification", model=str(checkpoint), device="cpu", top_k=None)(texts)
    for ours, theirs in zip(expected, from_pipeline):
        assert {d["label"]: d["score"] for d in theirs} == pytest.approx(ours["probabilities"], abs=1e-5)
    capsys.readouterr()
    assert main([str(checkpoint), *texts]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["label"] for p in printed] == [p["label"] for p in expected]


def test_padding_of_a_checkpoint_against_the_runs_is_named_where_it_differs():
    from finetune.resuming import padding_change

    assert padding_change({"padding_lengths": None}, None, False) is None
    assert padding_change({"padding_lengths": [8, 16]}, [8, 16], True) is None
    assert padding_change({"padding_lengths": None}, [4, 8], True) == "each to its longest text -> to lengths [4, 8]"
    # written before the lengths were recorded: a compiled (or graphed) run padded to quarters of max_length
    compiled = {"fingerprint": {"training.torch_compile": True, "data.max_length": 32}}
    assert padding_change(compiled, [8, 16, 24, 32], False) is None
    assert padding_change(compiled, [4, 8, 12, 16], False) == "to lengths [8, 16, 24, 32] -> to lengths [4, 8, 12, 16]"
    eager = {"fingerprint": {"training.torch_compile": False, "data.max_length": 32}}
    assert padding_change(eager, None, False) is None
    graphed = {"fingerprint": {"training.torch_compile": False, "training.cuda_graphs": True, "data.max_length": 32}}
    assert padding_change(graphed, [4, 8], True) == "to lengths [8, 16, 24, 32] -> to lengths [4, 8]"
    assert padding_change(graphed, None, False) is None  # true on a CPU: eager, each to its longest text


def test_a_resume_that_pads_otherwise_says_it_is_not_bitwise(tmp_path, caplog):
    """A checkpoint whose run padded to fixed lengths (another release's, say) resumes in a run that pads each
    micro-batch to its longest text: it goes on, and one warning says the rest is not bitwise."""
    import logging

    from finetune.checkpoint_files import MANIFEST_FILE, write_manifest
    from tiny_run import fit_tiny_run

    fit_tiny_run(tmp_path, on_update=lambda state: state.step >= 2, output={"checkpoint_every": 2})
    checkpoint = tmp_path / "out" / "checkpoints" / "checkpoint-2"
    state = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8"))
    assert state["padding_lengths"] is None  # eager on a CPU: each micro-batch to its longest text
    state["padding_lengths"] = [8, 16, 24, 32]
    (checkpoint / STATE_FILE).write_text(json.dumps(state), encoding="utf-8")
    (checkpoint / MANIFEST_FILE).unlink()
    write_manifest(checkpoint)
    with caplog.at_level(logging.WARNING, logger="finetune"):
        _, summary = fit_tiny_run(tmp_path, on_update=lambda state: state.step >= 3,
                                  output={"checkpoint_every": 2, "resume_from": "latest"})
    said = [r.getMessage() for r in caplog.records if "padded otherwise" in r.getMessage()]
    assert said == ["resuming with micro-batches padded otherwise than the checkpoint's run padded them (to lengths "
                    "[8, 16, 24, 32] -> each to its longest text): the rest of the run is the same training to float "
                    "rounding, but not bitwise the uninterrupted run, and dropout draws other masks"]
    assert summary["train"]["updates"] == 3
