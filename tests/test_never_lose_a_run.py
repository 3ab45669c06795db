"""What surrounds stopping and resuming: restarts, concurrent starts, damaged checkpoints, full disks.

Each scenario runs ``tests/interrupt_worker.py`` (``finetune/train.py`` with a
fault injected) in a subprocess on a tiny BERT, as an operator or a job
manager would: the same command again after a stop, a second run in a live
folder, bytes changed in a checkpoint, a disk that fills up.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.checkpoint import _attempt
from finetune.checkpoint_files import (MANIFEST_FILE, STATE_FILE, list_checkpoints, space_problem, verify_checkpoint,
                                      write_manifest)
from finetune.resuming import check_compatible, run_fingerprint
from finetune.config import config_from_dict
from finetune.errors import ConfigError
from finetune.outputs import LOCK_FILE, OutputLock
from finetune.tracking import RunLogger
import forked
from helpers import REPO, make_texts, offline_env, write_sms_job, write_tsv

WORKER = REPO / "tests" / "interrupt_worker.py"
TIMING = {"train/samples_per_s", "train/tokens_per_s"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The issue's short job: 12 updates of 16 samples (b=8, k=2), a checkpoint every 3, dropout on."""
    root = tmp_path_factory.mktemp("job")
    path = write_sms_job(
        root,
        training={"max_steps": 12, "per_device_train_batch_size": 8, "effective_batch_size": 16},
        output={"checkpoint_every": 3, "keep_last": 3},
    )
    reference = root / "reference"
    proc = _train(path, reference)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, path, reference


def _train(cfg: Path, out: Path, *overrides: str, threads: str = "1", **env: str) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, str(WORKER), "--config", str(cfg), f"output.output_dir={out}", *overrides],
                      env=offline_env({"FINETUNE_CPU_THREADS": threads, **env}), timeout=240)


def _errors(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("error:")]


def _records(out: Path) -> list[dict]:
    lines = (out / "train_log.jsonl").read_text(encoding="utf-8").splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in lines]


def _same_model(out: Path, reference: Path) -> bool:
    return (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def _files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes; the lock file aside, which names the last run that held the folder."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


@pytest.fixture(scope="module")
def stopped(job):
    """The job stopped by SIGTERM after update 7: checkpoints 3, 6 and 7 (every 3 updates, and at the stop).

    Each test that resumes, damages or replaces those checkpoints works on a copy (:func:`_copy`): one
    stopped run serves them all, the same state each time.
    """
    root, cfg, _ = job
    out = root / "stopped-at-7"
    proc = _train(cfg, out, FINETUNE_TEST_SIGNAL="7:SIGTERM")
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3", "checkpoint-6", "checkpoint-7"]
    return out


def _refused_untouched(proc, out: Path, before: dict[str, bytes]) -> str:
    """A resume refused in one line (returned), exit 2, no traceback, and no checkpoint, log or model of ``out``
    touched since ``before`` (config.yaml is the run's own again: a copy's named the folder it was copied from)."""
    assert proc.returncode == 2 and len(_errors(proc)) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    after = _files(out)
    assert after.pop("config.yaml") != before.pop("config.yaml") and after == before
    return _errors(proc)[0]


def _copy(stopped: Path, name: str) -> Path:
    out = stopped.parent / name
    shutil.copytree(stopped, out)
    return out


# --------------------------------------------------------------------------- restart = resume

@pytest.mark.slow
def test_the_identical_command_resumes_after_a_preemption(job):
    root, cfg, reference = job
    out = root / "requeued"
    stop = _train(cfg, out, FINETUNE_TEST_SIGNAL="5:SIGTERM")
    assert stop.returncode == 143, stop.stderr[-3000:]
    # one line says where it stopped, which checkpoint holds it and how to go on
    assert len(_errors(stop)) == 1, stop.stderr[-3000:]
    assert "interrupted by SIGTERM after update 5 (epoch 1, micro-batch 4)" in _errors(stop)[0]
    assert "checkpoint-5" in _errors(stop)[0] and "output.resume_from=latest" in _errors(stop)[0]
    # 3 updates an epoch: the log says epoch 1 stopped part-way, not that it ended
    assert "epoch 1 stopped at update 5, micro-batch 4 of 6: updates 4-5, loss" in stop.stderr, stop.stderr[-3000:]
    assert "epoch 0 done: updates 1-3, loss" in stop.stderr and "epoch 1 done" not in stop.stderr
    saved = json.loads((out / "checkpoints" / "checkpoint-5" / STATE_FILE).read_text())["state"]
    assert (saved["epoch"], saved["micro_batch"]) == (1, 4)  # mid-epoch: 4 of 6 micro-batches
    assert [r["step"] for r in _records(out) if "train/loss" in r] == [1, 2, 3, 4, 5]
    proc = _train(cfg, out)  # requeued as it was: no resume_from on the command line
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "checkpoint-5: update 5" in proc.stderr
    assert "epoch 1 done: updates 6-6, loss" in proc.stderr and "epoch 0 done" not in proc.stderr
    assert _same_model(out, reference) and _records(out) == _records(reference)
    metrics, expected = (json.loads((d / "metrics.json").read_text()) for d in (out, reference))
    # metrics.json's time covers the same span as its counts: the updates before the stop too
    assert metrics["train"]["seconds"] > saved["train_seconds"] > 0
    for m in (metrics, expected):
        m["train"].pop("seconds")
        m["memory_plan"].pop("available")  # the machine's free memory at each start
    assert metrics == expected
    # and once more: a finished run requeued resumes from its last checkpoint and changes nothing
    before = (out / "model.safetensors").read_bytes()
    proc = _train(cfg, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").read_bytes() == before and _records(out) == _records(reference)


@pytest.mark.slow
def test_a_longer_run_in_a_runs_folder_is_told_to_start_from_that_runs_model(job, stopped):
    """Its schedule was planned for its own length, so a run cannot be resumed for longer; the refusal says how
    to go on from its model: the finished one, or, stopped, its newest checkpoint (a model folder too)."""
    root, cfg, reference = job
    finished, interrupted = root / "longer", _copy(stopped, "stopped-longer")
    shutil.copytree(reference, finished)
    for out, model in ((finished, finished), (interrupted, interrupted / "checkpoints" / "checkpoint-7")):
        before = _files(out)
        proc = _train(cfg, out, "training.max_steps=20")
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-2:] == [
            _errors(proc)[0],
            f"hint: to train that run's model further, start a new run from it: the same command with --model "
            f"{model} --output {out.parent / (out.name + '-continued')} (a schedule and optimizer of its own)"]
        assert "holds checkpoints of another run (training.max_steps: 12 -> 20)" in _errors(proc)[0]
        assert _files(out) == before
    # any other change as well: not a longer run of the same training, no such hint
    proc = _train(cfg, finished, "training.max_steps=20", "optim.learning_rate=3e-4")
    assert proc.returncode == 2 and "hint:" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_another_runs_checkpoints_are_refused_and_left_alone(job):
    root, cfg, reference = job
    out = root / "other"
    shutil.copytree(reference, out)
    before = _files(out)
    proc = _train(cfg, out, "optim.learning_rate=3e-4")
    assert proc.returncode == 2 and len(_errors(proc)) == 1, proc.stderr[-3000:]
    line = _errors(proc)[0]
    assert f"{out} holds checkpoints of another run (optim.learning_rate: 0.001 -> 0.0003" in line
    assert "pass output.overwrite=true" in line
    # refused first: before the model or the data were read, the start line or anything else said
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-3000:]
    assert _files(out) == before  # not a byte changed
    # told to, it replaces that run
    proc = _train(cfg, out, "optim.learning_rate=3e-4", "output.overwrite=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not _same_model(out, reference)


@pytest.mark.slow
def test_a_data_file_edited_in_place_is_another_run(job):
    root, cfg, _ = job
    data = write_tsv(root / "edited.tsv", make_texts(60, seed=3))
    source = yaml.safe_load(cfg.read_text())
    source["data"]["train_file"] = str(data)
    own_cfg = root / "edited.yaml"
    own_cfg.write_text(yaml.safe_dump(source), encoding="utf-8")
    out = root / "edited"
    assert _train(own_cfg, out, FINETUNE_TEST_SIGNAL="3:SIGTERM").returncode == 143
    rows = make_texts(60, seed=3)
    rows[10] = (rows[10][0], rows[10][1] + " free")  # same path, same row count, one text changed
    write_tsv(data, rows)
    before = _files(out)
    proc = _train(own_cfg, out)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "holds checkpoints of another run (data.train_sha256:" in _errors(proc)[0]
    assert _files(out) == before


@pytest.mark.slow
def test_another_thread_count_on_resume_is_said(job, stopped):
    root, cfg, reference = job
    out = _copy(stopped, "threads")
    proc = _train(cfg, out, threads="2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming with 2 CPU threads per process, the checkpoint ran with 1" in proc.stderr


# --------------------------------------------------------------------------- one run per folder

def test_a_live_folder_turns_a_second_run_away_without_touching_it(job, tmp_path):
    root, cfg, reference = job
    out = tmp_path / "live"
    shutil.copytree(reference, out)
    before = _files(out)
    with OutputLock(out):  # this test process is the live run
        proc = _train(cfg, out)
    assert proc.returncode == 2 and len(_errors(proc)) == 1, proc.stderr[-3000:]
    assert f"output.output_dir: {out} is in use by another run (pid {os.getpid()} on" in _errors(proc)[0]
    assert _files(out) == before
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()  # still ours


def test_a_lock_left_by_a_dead_run_is_not_in_the_way(tmp_path):
    # a run killed with SIGKILL leaves the file; the operating system has released its lock
    proc = subprocess.run([sys.executable, "-c", (
        "import os, sys; sys.path.insert(0, '.'); from finetune.outputs import OutputLock; "
        f"OutputLock({str(tmp_path)!r}).acquire(); os.kill(os.getpid(), 9)")], cwd=REPO)
    assert proc.returncode == -9 and (tmp_path / LOCK_FILE).is_file()
    with OutputLock(tmp_path):
        holder = json.loads((tmp_path / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {os.getpid()} on"):
            _second_holder(tmp_path)


def test_a_system_without_file_locks_trains_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # as on Windows: importing it fails
    with caplog.at_level("WARNING", logger="finetune"), OutputLock(tmp_path / "out") as lock:
        assert lock._fd is None and (tmp_path / "out").is_dir()
    assert "this system has no file locks (fcntl): a second run in" in caplog.text


def _second_holder(folder: Path) -> None:
    """Another open file description of the lock: flock sees it as a second holder, as another process would."""
    OutputLock(folder).acquire()


# --------------------------------------------------------------------------- checkpoints that prove themselves

@pytest.mark.slow
def test_damaged_checkpoints_are_passed_over_for_the_newest_intact_one(job, stopped):
    root, cfg, reference = job
    out = _copy(stopped, "damaged")  # checkpoints 3, 6 and 7
    ckpt = out / "checkpoints"
    with open(ckpt / "checkpoint-7" / "model.safetensors", "r+b") as fh:  # 4 KiB of random bytes inside
        fh.seek(2048)
        fh.write(os.urandom(4096))
    (ckpt / "checkpoint-6" / STATE_FILE).write_text("{garbage", encoding="utf-8")
    proc = _train(cfg, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "passing over" in line]
    assert len(warnings) == 2, proc.stderr[-3000:]
    assert "checkpoint-6: its trainer_state.json is missing or unreadable" in warnings[0]
    assert "checkpoint-7: model.safetensors does not hold the bytes that were saved" in warnings[1]
    assert "checkpoint-3: update 3" in proc.stderr
    assert _same_model(out, reference) and _records(out) == _records(reference)


@pytest.mark.slow
def test_with_no_intact_checkpoint_left_the_run_stops_in_one_line(job, stopped):
    root, cfg, _ = job
    out = _copy(stopped, "all-damaged")  # checkpoints 3, 6 and 7
    for ckpt in list_checkpoints(out):
        with open(ckpt / "optimizer.bin", "r+b") as fh:
            fh.truncate(100)
    before = _files(out)
    proc = _train(cfg, out)
    assert proc.returncode == 2 and len(_errors(proc)) == 1, proc.stderr[-3000:]
    assert "no checkpoint in" in _errors(proc)[0] and "is intact" in _errors(proc)[0]
    assert "optimizer.bin has 100 bytes" in proc.stderr
    assert _files(out) == before


def test_verification_names_what_changed(tmp_path, job):
    _, _, reference = job
    ckpt = tmp_path / "checkpoint-12"
    shutil.copytree(list_checkpoints(reference)[-1], ckpt)
    assert verify_checkpoint(ckpt) is None
    (ckpt / "model.safetensors").unlink()  # once reported as a missing pytorch_model.bin
    assert verify_checkpoint(ckpt) == "model.safetensors is missing"
    (ckpt / MANIFEST_FILE).unlink()
    assert verify_checkpoint(ckpt) == "manifest.json is missing or unreadable"


class _NotPlainData:
    pass


@pytest.mark.slow
def test_an_unsafe_pickle_is_refused_in_one_line(job, stopped):
    root, cfg, _ = job
    out = _copy(stopped, "unsafe")
    ckpt = out / "checkpoints" / "checkpoint-3"
    with open(ckpt / "optimizer.bin", "wb") as fh:
        pickle.dump({"state": _NotPlainData()}, fh)
    # a checkpoint of the first format has no manifest to catch the change: the loader must refuse it
    meta = json.loads((ckpt / STATE_FILE).read_text())
    meta["format"] = 1
    (ckpt / STATE_FILE).write_text(json.dumps(meta), encoding="utf-8")
    (ckpt / MANIFEST_FILE).unlink()
    proc = _train(cfg, out, f"output.resume_from={ckpt}")
    assert proc.returncode == 2 and len(_errors(proc)) == 1, proc.stderr[-3000:]
    assert "not plain tensors and data, so it is not loaded" in _errors(proc)[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_an_optimizer_state_of_other_parameter_groups_is_refused_in_one_line(job, stopped):
    """A checkpoint whose optimizer grouped the weights otherwise (an earlier release counted a family's layers
    differently, so layer-wise rates or frozen blocks grouped them otherwise), intact as that release wrote it."""
    root, cfg, _ = job
    out = _copy(stopped, "regrouped")
    ckpt = out / "checkpoints" / "checkpoint-7"
    state = torch.load(ckpt / "optimizer.bin", weights_only=True)
    first, second = state["param_groups"][:2]
    second["params"].append(first["params"].pop())  # one weight in the other group
    torch.save(state, ckpt / "optimizer.bin")
    write_manifest(ckpt)
    before = _files(out)
    proc = _train(cfg, out)
    assert f"error: {ckpt}: its optimizer state holds other parameter groups" in _refused_untouched(proc, out, before)
    assert "hint: resume it with the finetune that wrote it" in proc.stderr


@pytest.mark.slow
def test_a_checkpoint_whose_random_states_do_not_load_is_refused_in_one_line(job, stopped):
    """Accelerate logs a process's random states that fail to load and goes on; resumed without them, the run
    would draw other dropout masks than the one it continues. Here the file is gone and the manifest written
    again to match, as a copy that lost it and was then re-verified would be."""
    root, cfg, _ = job
    out = _copy(stopped, "no-random-states")
    ckpt = out / "checkpoints" / "checkpoint-7"
    (ckpt / "random_states_0.pkl").unlink()
    write_manifest(ckpt)
    before = _files(out)
    proc = _train(cfg, out)
    assert _refused_untouched(proc, out, before).startswith(
        f"error: {ckpt}: could not restore the random number generator states (random_states_0.pkl)")
    assert "hint: resume from an earlier checkpoint (output.resume_from=<its directory>)" in proc.stderr


@pytest.mark.slow
def test_a_checkpoint_of_nan_weights_is_refused_in_one_line(job, stopped):
    """A checkpoint whose files are intact (the manifest agrees) but whose weights hold a NaN, as one saved by a
    run that had diverged: resumed, every update after it would be NaN."""
    from safetensors.torch import load_file, save_file

    root, cfg, _ = job
    out = _copy(stopped, "nan-weights")
    ckpt = out / "checkpoints" / "checkpoint-7"
    weights = load_file(ckpt / "model.safetensors")
    weights["classifier.weight"][0, 0] = float("nan")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    write_manifest(ckpt)
    before = _files(out)
    proc = _train(cfg, out)
    assert _refused_untouched(proc, out, before) == (f"error: {ckpt}: weight classifier.weight holds NaN or inf "
                                                     f"values; resume from an earlier checkpoint "
                                                     f"(output.resume_from=<its directory>)")


def test_loaded_weights_must_be_finite(job, tmp_path):
    """A checkpoint whose files are intact but whose weights are NaN (saved from a run that diverged)."""
    from finetune.checkpoint import check_finite
    from helpers import tiny_bert

    model = tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters())
    run = type("Run", (), {"model": model, "optimizer": optimizer,
                           "accelerator": type("A", (), {"unwrap_model": staticmethod(lambda m: m)})()})()
    check_finite(run, tmp_path)
    with torch.no_grad():
        model.classifier.weight[0, 0] = float("nan")
    with pytest.raises(Exception, match=r"weight classifier.weight holds NaN or inf values"):
        check_finite(run, tmp_path)


# --------------------------------------------------------------------------- out of memory mid-run

# equal cuts: a balanced micro-batch may hold more than b short texts, which the injected device counts as rows
EQUAL_CUTS = "data.balance_micro_batches=false"


def _hints(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("hint:")]


@pytest.mark.slow
def test_out_of_memory_mid_run_is_one_line_whose_hint_resumes_the_same_updates(job):
    """A device with room for 4 rows from update 5 on: b=8 stops with exit code 5, naming the newest checkpoint,
    and the hint's half micro-batch (k doubled, the same B) resumes it on that device to the end."""
    root, cfg, _ = job
    out = root / "out-of-memory"
    proc = _train(cfg, out, EQUAL_CUTS, FINETUNE_TEST_OOM="8:4")  # forwards 8 and 9 are update 5's
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    checkpoint = out / "checkpoints" / "checkpoint-3"
    assert _errors(proc) == [f"error: out of memory on cpu in update 5 (epoch 1), at b=8; the newest checkpoint is "
                             f"{checkpoint}"]
    assert _hints(proc) == ["hint: the same command with training.per_device_train_batch_size=4 resumes it from "
                            "checkpoint-3: k=4, the same updates (effective batch 16) on about half the "
                            "activation memory"]
    assert verify_checkpoint(checkpoint) is None  # intact: its files are those its manifest lists
    # what it says works: the same command with the hint's setting, on the same device
    setting = _hints(proc)[0].split("the same command with ")[1].split(" resumes")[0]
    proc = _train(cfg, out, EQUAL_CUTS, setting, FINETUNE_TEST_OOM="8:4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resumed from {checkpoint}: update 3" in proc.stderr
    assert [r["step"] for r in _records(out) if "train/loss" in r] == list(range(1, 13))


@pytest.mark.slow
def test_out_of_memory_in_an_evaluation_before_any_checkpoint_says_how_to_start_again(job):
    root, cfg, _ = job
    out = root / "out-of-memory-evaluating"
    proc = _train(cfg, out, FINETUNE_TEST_OOM_EVAL="8")  # the 12 validation rows: one batch of 12 at the default
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert _errors(proc) == ["error: out of memory on cpu evaluating after update 3, at "
                             "training.per_device_eval_batch_size=64; no checkpoint was saved yet"]
    assert _hints(proc) == ["hint: the same command with training.per_device_eval_batch_size=6 output.overwrite=true "
                            "starts it again (it saved no checkpoint): the evaluation batch does not change the "
                            "training"]
    settings = _hints(proc)[0].split("the same command with ")[1].split(" starts")[0].split()
    proc = _train(cfg, out, *settings, FINETUNE_TEST_OOM_EVAL="8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["train"]["updates"] == 12


@pytest.mark.slow
def test_out_of_memory_in_a_dry_run_names_its_update_and_how_to_try_again(job):
    """A dry run that runs out of memory, training or in its evaluation, says where as a run would, and that
    the same command tries it again with the hint's setting: a dry run wrote nothing to start again over."""
    root, cfg, _ = job
    out = root / "out-of-memory-dry-run"
    # the first epoch's 3 updates train, then its evaluation (the 12 validation rows in one batch) fails
    proc = _train(cfg, out, "--dry-run", FINETUNE_TEST_OOM_EVAL="8")
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert _errors(proc) == ["error: out of memory on cpu evaluating after update 3, at "
                             "training.per_device_eval_batch_size=64; in a dry run"]
    assert _hints(proc) == ["hint: the same command with training.per_device_eval_batch_size=6 tries it again: the "
                            "evaluation batch does not change the training"]
    setting = _hints(proc)[0].split("the same command with ")[1].split(" tries")[0]
    proc = _train(cfg, out, "--dry-run", setting, FINETUNE_TEST_OOM_EVAL="8")
    assert proc.returncode == 0 and "dry run: 3 updates trained" in proc.stderr, proc.stderr[-3000:]
    # a training micro-batch that does not fit, from the second update's on
    proc = _train(cfg, out, "--dry-run", EQUAL_CUTS, FINETUNE_TEST_OOM="2:4")
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert _errors(proc) == ["error: out of memory on cpu in update 2 (epoch 0), at b=8; in a dry run"]
    assert _hints(proc) == ["hint: the same command with training.per_device_train_batch_size=4 tries it again: k=4, "
                            "the same updates (effective batch 16) on about half the activation memory"]
    assert not out.exists()


# --------------------------------------------------------------------------- a full disk

@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoints(job):
    root, cfg, _ = job
    out = root / "full"
    proc = _train(cfg, out, FINETUNE_TEST_ENOSPC_AT="6")
    assert proc.returncode == 4 and len(_errors(proc)) == 1, proc.stderr[-3000:]
    line = _errors(proc)[0]
    assert f"cannot save checkpoint-6 in {out / 'checkpoints'}: no space left on device" in line
    assert "Traceback" not in proc.stderr
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-3"]  # no temporary left
    assert verify_checkpoint(out / "checkpoints" / "checkpoint-3") is None
    proc = _train(cfg, out)  # space freed: the same command resumes
    assert proc.returncode == 0 and "checkpoint-3: update 3" in proc.stderr, proc.stderr[-3000:]


def test_torchs_failed_write_on_a_full_disk_is_named_as_such(tmp_path, monkeypatch):
    def torch_write():
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2048 vs 1964")

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 0))
    assert _attempt(torch_write, tmp_path) == "no space left on device"
    with pytest.raises(RuntimeError, match="something else"):  # another error is not taken for a write failure
        _attempt(lambda: (_ for _ in ()).throw(RuntimeError("something else")), tmp_path)


def test_a_save_is_refused_before_writing_when_the_last_checkpoint_would_not_fit(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints" / "checkpoint-3"
    ckpt.mkdir(parents=True)
    (ckpt / STATE_FILE).write_text(json.dumps({"format": 2, "state": {}}), encoding="utf-8")
    (ckpt / "model.safetensors").write_bytes(b"\0" * 5_000_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 10**6, 10**6))
    assert space_problem(tmp_path / "checkpoints") == (
        "no space left for a checkpoint: 1 MB free, the last one took 5 MB")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 0, 10**9))
    assert space_problem(tmp_path / "checkpoints") is None


# --------------------------------------------------------------------------- the smaller items

@pytest.mark.slow
def test_a_signal_during_the_final_writes_lets_them_finish(job):
    root, cfg, reference = job
    out = root / "final-signal"
    proc = _train(cfg, out, FINETUNE_TEST_SIGNAL_IN_FINAL_WRITE="SIGTERM")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SIGTERM came while the final outputs were written; they are complete" in proc.stderr
    assert _same_model(out, reference)
    for name in ("metrics.json", "all_results.json"):
        json.loads((out / name).read_text())
    assert not list(out.glob(".*tmp*"))


@pytest.mark.slow
def test_a_skipped_update_is_said_when_it_happens_and_a_nan_stop_says_how_to_go_on(job):
    root, cfg, _ = job
    proc = _train(cfg, root / "skip", "training.on_nonfinite=skip", FINETUNE_TEST_NAN_AT="4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped update 3: non-finite loss (nan)" in proc.stderr  # forward 4: the 3rd window of 2
    out = root / "nan-stop"
    proc = _train(cfg, out, FINETUNE_TEST_NAN_AT="8")  # update 5: after checkpoint-3
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = _errors(proc)[0]
    assert "start a run from its weights: model.name_or_path=" in line
    suggested = line.split("model.name_or_path=")[1].split(" ")[0]
    assert suggested == str(out / "checkpoints" / "checkpoint-3")
    # what it says works: a new run from those weights, with a lower learning rate
    proc = _train(cfg, root / "nan-go-on", f"model.name_or_path={suggested}", "optim.learning_rate=1e-4")
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_an_evaluation_cut_short_on_resume_leaves_no_duplicate_record(tmp_path):
    log = tmp_path / "train_log.jsonl"
    kept_eval = {"step": 4, "epoch": 1, "eval/loss": 0.5}
    lines = [{"step": 3, "train/loss": 0.7}, {"step": 4, "train/loss": 0.6}, kept_eval,
             {"step": 4, "eval/loss": 0.4}, {"step": 5, "train/loss": 0.3}]
    log.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    acc = type("A", (), {"is_main_process": True})()
    RunLogger(acc, tmp_path, resume_step=4, history=[kept_eval])
    assert [json.loads(line) for line in log.read_text().splitlines()] == lines[:3]


def test_a_changed_effective_batch_is_named_as_such(tmp_path):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from finetune.accumulation import resolve_batching
    from finetune.autobatch import Checkpointing
    from finetune.optimization import plan_updates

    def fake(B):
        cfg = config_from_dict({"data": {"train_file": "x.tsv"},
                                "training": {"per_device_train_batch_size": 4, "effective_batch_size": B}})
        batching = resolve_batching(cfg.training, 1)
        plan = plan_updates(12, batching.gradient_accumulation_steps, 1, None)
        accelerator = SimpleNamespace(mixed_precision="no", distributed_type=DistributedType.NO,
                                      device=torch.device("cpu"), num_processes=1)
        return SimpleNamespace(cfg=cfg, batching=batching, plan=plan, accelerator=accelerator,
                               checkpointing=Checkpointing(), train_dataloader=SimpleNamespace(dataset=range(48)),
                               labels=SimpleNamespace(names=["ham", "spam"]),
                               data_sha256="x")

    with pytest.raises(ConfigError, match=r"other settings: effective_batch_size: 12 -> 24; "):
        check_compatible({"fingerprint": run_fingerprint(fake(12))}, fake(24), tmp_path)
