"""Same math on every process count (ACCUMULATION.md §1-6 with P > 1), on the CPU.

* The loop under ``accelerate launch --multi_gpu --num_processes 2`` on a
  machine without a GPU is one real DDP job over gloo, and ``(b=4, k=2, P=2)``
  gives the weights of ``(b=16, k=1, P=1)`` after every update, the ragged end
  of each epoch included; DDP communicates once per update; the schedule, the
  logged loss and the evaluation agree with the single process.
* The command line: ``effective_batch_size`` keeps ``B`` fixed while ``k``
  follows ``P``; one process, two processes and two "machines" on one host
  (loopback) end with the same model, log and metrics, using the shipped
  ``configs/accelerate/`` files.
* The shipped Accelerate configs parse through Accelerate's own launcher code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from finetune.config import TrainingConfig
from finetune.errors import ConfigError
from finetune.accumulation import resolve_batching
import forked
from helpers import REPO, free_port, make_texts, offline_env, save_tiny_model, write_tsv

ACCEL_CONFIGS = REPO / "configs" / "accelerate"
# Every subprocess here runs on the CPU, whatever the machine has, so results compare across runs.
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
TIMEOUT = 300  # seconds per launch: a hang fails the test instead of blocking CI


def _launcher(*flags: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", *flags]


def _two_process_flags() -> list[str]:
    """``accelerate launch`` flags for two processes on this machine, each call on a free port."""
    return ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--main_process_port", str(free_port()),
            "--mixed_precision", "no", "--dynamo_backend", "no"]


def _start(cmd: list[str]):
    """``cmd`` started in a session of its own, so that a hang kills its workers with it (forked: ``tests/forked``)."""
    return forked.start(cmd, env=offline_env(CPU_ONLY), start_new_session=True)


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run ``cmd`` and kill it and its workers if it outlives TIMEOUT."""
    return _wait(_start(cmd), cmd)


def _wait(proc, cmd) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's children (torchrun workers) too
        out, err = proc.communicate()
        pytest.fail(f"{cmd} hung for {TIMEOUT}s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


# --- effective batch -------------------------------------------------------------------------


@pytest.mark.parametrize("processes, expected_k", [(1, 8), (2, 4), (8, 1)])
def test_effective_batch_fixes_k_for_each_process_count(processes, expected_k):
    training = TrainingConfig(per_device_train_batch_size=4, effective_batch_size=32)
    batching = resolve_batching(training, processes)
    assert batching.gradient_accumulation_steps == expected_k
    assert batching.effective_batch_size == 32


def test_effective_batch_that_does_not_divide_names_b_b_and_p():
    training = TrainingConfig(per_device_train_batch_size=4, effective_batch_size=32)
    with pytest.raises(ConfigError) as err:
        resolve_batching(training, 3)
    message = str(err.value)
    assert "\n" not in message and message.startswith("training.effective_batch_size: ")
    numbers = re.findall(r"\d+", message)
    assert {"32", "4", "3"} <= set(numbers)  # B, b and P


def test_both_keys_must_agree():
    consistent = TrainingConfig(per_device_train_batch_size=4, effective_batch_size=32, gradient_accumulation_steps=4)
    assert resolve_batching(consistent, 2).gradient_accumulation_steps == 4
    with pytest.raises(ConfigError, match="gradient_accumulation_steps: 4 contradicts effective_batch_size 32"):
        resolve_batching(consistent, 1)
    plain = TrainingConfig(per_device_train_batch_size=4, gradient_accumulation_steps=3)
    # without effective_batch_size, k is kept and B grows with P
    assert resolve_batching(plain, 2).effective_batch_size == 24


# --- the loop on 2 processes -------------------------------------------------------------------


# FSDP2 orders its all-gathers by stream events, which older torch releases give CUDA streams only
FSDP2_ON_CPU = hasattr(torch.cpu.Stream, "record_event")


def _in_this_process(**settings) -> dict:
    """``scaling_worker.record_run`` on one process, in this one, with Accelerate's singletons reset around it."""
    from accelerate.state import AcceleratorState, GradientState

    from scaling_worker import record_run

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        return record_run(cpu=True, **settings)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def _on_two_processes(out: Path, *scenarios: str) -> dict[str, list[dict]]:
    """``tests/scaling_worker.py`` through ``accelerate launch --multi_gpu`` on the CPU, without telling it cpu:
    each scenario's rank records by name, rank 0's with its weights after every update (``snapshots``)."""
    cmd = _launcher(*_two_process_flags(), str(REPO / "tests" / "scaling_worker.py"), "--out", str(out), *scenarios)
    proc = _run(cmd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = {}
    for name in scenarios:
        ranks = [json.loads((out / name / f"rank{r}.json").read_text()) for r in (0, 1)]
        ranks[0]["snapshots"] = torch.load(out / name / "snapshots.pt")
        runs[name] = ranks
    return runs


@pytest.fixture(scope="module")
def one_process():
    """``(b=16, k=1, P=1)``, in this process."""
    return _in_this_process(b=16, k=1)


@pytest.fixture(scope="module")
def on_two_processes(tmp_path_factory):
    """Every scenario of ``tests/scaling_worker.py`` on two processes, in one launch (``(b=4, k=2, P=2)`` each)."""
    out = tmp_path_factory.mktemp("two_processes")
    fsdp2 = ("fsdp2",) if FSDP2_ON_CPU else ()
    runs = _on_two_processes(out, "plain", "schedule", "chunks", "casts", *fsdp2, "noise")
    runs["casts"][0]["snapshots_every"] = torch.load(out / "casts" / "snapshots_every.pt")
    return runs


@pytest.fixture(scope="module")
def two_processes(on_two_processes):
    """``(b=4, k=2, P=2)`` on two processes."""
    return on_two_processes["plain"]


@pytest.mark.slow
def test_an_accumulation_schedule_on_two_processes_gives_the_single_process_weights(on_two_processes):
    """``k`` by epoch, ``{0: 2, 1: 1}`` on 2 processes of ``b=4``, is ``{0: 4, 1: 2}`` on one: B = 16, then 8."""
    single = _in_this_process(b=4, k=4, schedule={0: 4, 1: 2})
    rank0 = on_two_processes["schedule"][0]
    multi = rank0["snapshots"]
    # epoch 0: windows of 16, 16, 2 samples; epoch 1: of 8, 8, 8, 8, 2
    assert rank0["plan"] == [3, 8] and rank0["steps"] == rank0["scheduler_calls"] == 8
    assert len(multi) == len(single["snapshots"]) == 8
    for update, (a, b) in enumerate(zip(single["snapshots"], multi)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    assert [r["train/effective_batch_size"] for r in rank0["records"]] == [16] * 3 + [8] * 5
    assert rank0["lrs"] == pytest.approx(single["lrs"], rel=1e-12) and rank0["final_lr"] == 0.0


@pytest.mark.slow
def test_chunked_texts_on_two_processes_give_the_single_process_weights_and_evaluation(on_two_processes):
    """Texts of 1 to 5 windows: ``(4, 2, 2)`` trains ``(16, 1, 1)``'s weights; the evaluation counts each text once.

    Process 1's last micro-batch is all repeated texts (weight 0), and the
    evaluation's last batches are padded with repeats that ``gather_for_metrics``
    drops: it must see texts, one output each, not windows.
    """
    from scaling_worker import N_EVAL

    single = _in_this_process(b=16, k=1, chunks=True)
    rank0 = on_two_processes["chunks"][0]
    multi = rank0["snapshots"]
    assert len(multi) == len(single["snapshots"]) == 6
    for update, (a, b) in enumerate(zip(single["snapshots"], multi)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    assert rank0["eval"]["num_samples"] == single["eval"]["num_samples"] == N_EVAL
    assert rank0["eval"]["loss"] == pytest.approx(single["eval"]["loss"], rel=1e-5)
    assert rank0["eval"]["accuracy"] == single["eval"]["accuracy"]


@pytest.mark.slow
def test_weight_casts_kept_for_the_window_under_ddp_train_the_same_weights_bitwise(on_two_processes):
    """bf16 on 2 processes: autocast's copies shared by a window's micro-batches (DDP skips the all-reduce for
    all but the last) give bitwise the weights of copies made in every micro-batch."""
    rank0 = on_two_processes["casts"][0]
    every, once = rank0["snapshots_every"], rank0["snapshots"]
    assert rank0["distributed_type"] == "DistributedType.MULTI_CPU" and len(once) == len(every) == 6
    for update, (a, b) in enumerate(zip(every, once)):
        for name in a:
            assert torch.equal(a[name], b[name]), f"update {update + 1}, {name}"
    assert not torch.equal(once[0]["classifier.weight"], once[-1]["classifier.weight"])
    assert rank0["comm_at"] == [2, 4, 5, 7, 9, 10]  # once per window, at its last micro-batch (one bucket)


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="this torch's FSDP2 does not run on a CPU (its CPU streams record no events)")
def test_fsdp2_sharded_weights_on_two_processes_train_the_single_process_weights(one_process, on_two_processes):
    """Parameters, gradients and AdamW's state sharded by FSDP2 (fully_shard), (4, 2, 2) against (16, 1, 1):
    the same weights after every update, and the same clipped gradient norm (FSDP2 returns it as a DTensor,
    which the loop gathers whole before adding it to the log's device total).

    Accelerate's no_sync does not reach a model sharded by hand, so each micro-batch's gradient is reduced on its
    own: the sums run in another order than DDP's, and AdamW's division by the root of the second moment turns
    a difference in the last bits of a small gradient into about 1e-7 of a weight, hence an atol of 1e-6 (as on
    a GPU)."""
    rank0 = on_two_processes["fsdp2"][0]
    big, small = one_process["snapshots"], rank0["snapshots"]
    assert len(big) == len(small) == 6
    for update, (a, b) in enumerate(zip(big, small)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")
    norms = [r["train/grad_norm"] for r in rank0["records"]]
    # the sums' other order rounds a small norm (0.0036 at the third update) by 4e-8 on some CPUs: relative to
    # it, 1.07e-5; a window mis-weighted, or a shard's gradient left out, moves a norm by a share of itself
    assert norms == pytest.approx([r["train/grad_norm"] for r in one_process["records"]], rel=1e-5, abs=1e-7)
    assert [r["train/loss"] for r in rank0["records"]] == \
        pytest.approx([r["train/loss"] for r in one_process["records"]], rel=1e-6)


@pytest.mark.slow
def test_the_noise_scale_on_two_processes_is_the_one_every_samples_gradient_gives(on_two_processes):
    """The linear model of tests/test_noise_scale.py at a learning rate of 0, in windows of 16 of two processes'
    micro-batches of 4: each process's first micro-batch counts through the window's all-reduce, so both processes
    hold the same estimate, within 10% of tr(S)/|G|^2 over all 2,048 rows' gradients after 1,024 updates (a
    process's small batch counted at the window's size, or left out, lands far off; one counted alone, apart)."""
    from test_noise_scale import Linear, exact_noise_scale, rows

    ranks = on_two_processes["noise"]
    assert [r["processes"] for r in ranks] == [2, 2] and ranks[0]["updates"] == 1024
    assert ranks[0]["noise_scale"] == ranks[1]["noise_scale"]
    assert ranks[0]["noise_scale"] == pytest.approx(exact_noise_scale(Linear(), rows()), rel=0.1)


def test_two_processes_are_one_ddp_job_over_gloo(two_processes):
    assert [r["process_index"] for r in two_processes] == [0, 1]
    for r in two_processes:
        assert r["num_processes"] == 2
        assert r["backend"] == "gloo"
        assert r["distributed_type"] == "DistributedType.MULTI_CPU"


def test_two_processes_give_the_single_process_weights_after_every_update(one_process, two_processes):
    big, small = one_process["snapshots"], two_processes[0]["snapshots"]
    # 34 samples in windows of 16, 16 and 2 (process 1's last micro-batch is all repeats), 2 epochs
    assert len(big) == len(small) == 6
    for update, (a, b) in enumerate(zip(big, small)):
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"update {update + 1}, {name}: {m}")


def test_ddp_all_reduces_once_per_update(two_processes):
    # micro-batches (counted from 1 over both epochs) that end a window: k=2, 5 per epoch per process
    window_ends = [2, 4, 5, 7, 9, 10]
    for r in two_processes:
        comm = r["comm_at"]
        buckets = comm.count(window_ends[0])
        assert buckets >= 1
        # gradients travel during the last micro-batch of each window and at no other time
        assert comm == [end for end in window_ends for _ in range(buckets)]


def test_ddp_holds_each_gradient_once_as_a_view_into_its_buckets(two_processes):
    """DDP all-reduces through buckets of its own; the gradients are views into them (``ddp_settings``), kept
    from update to update (``frees_gradients``), rather than a second copy of every gradient beside them."""
    for r in two_processes:
        assert r["gradients"] == r["trained_parameters"] > 20  # kept after the last update: not freed
        assert r["gradient_storages"] <= 2  # the tiny BERT fits one or two buckets of 25 MB


def test_schedule_advances_once_per_update_on_two_processes(one_process, two_processes):
    for r in two_processes:
        assert r["plan"] == [3, 6] and r["steps"] == 6
        assert r["scheduler_calls"] == 6  # not 12: the scheduler is not Accelerate-prepared
        assert r["lrs"] == pytest.approx(one_process["lrs"], rel=1e-12)
        assert r["final_lr"] == 0.0  # the end value after the last update...
        assert min(r["lrs"][1:]) > 0  # ...and not before


def test_logged_loss_matches_the_single_process(one_process, two_processes):
    rank0, rank1 = two_processes
    assert [r["step"] for r in rank0["records"]] == list(range(1, 7))
    for single, multi in zip(one_process["records"], rank0["records"]):
        assert multi["train/loss"] == pytest.approx(single["train/loss"], rel=1e-5)
        assert multi["train/grad_norm"] == pytest.approx(single["train/grad_norm"], rel=1e-5)
        # repeats added to even out the processes are not counted as samples
        assert multi["train/samples"] == single["train/samples"]
    assert rank0["records"][2]["train/samples"] == 34
    # every process computes the same record (only the main one writes it: see the CLI tests)
    assert [r["train/loss"] for r in rank1["records"]] == [r["train/loss"] for r in rank0["records"]]


def test_evaluation_counts_every_example_once(one_process, two_processes):
    for r in two_processes:
        assert r["eval"]["num_samples"] == one_process["eval"]["num_samples"] == 23
        assert r["eval"]["accuracy"] == one_process["eval"]["accuracy"]
        assert r["eval"]["f1"] == one_process["eval"]["f1"]
        assert r["eval"]["loss"] == pytest.approx(one_process["eval"]["loss"], rel=1e-5)
        # each text's probabilities gathered beside its label, once: the texts ranked as one process ranks them
        # (the tiny model's probabilities differ from text to text, so another pairing would rank otherwise)
        for name in ("roc_auc", "average_precision"):
            assert r["eval"][name] == pytest.approx(one_process["eval"][name], abs=1e-6)


# --- the command line: one process, two processes, two machines ------------------------------

N_ROWS = 67


@pytest.fixture(scope="module")
def cli_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model(root / "tiny-bert")
    data = write_tsv(root / "texts.tsv", make_texts(N_ROWS, seed=4))
    cfg = {
        "model": {"name_or_path": str(model), "dropout": 0.0},
        "data": {"train_file": str(data), "format": "tsv", "has_header": False, "column_names": ["label", "text"],
                 "validation_split": 0.2, "max_length": 32},
        "training": {"per_device_train_batch_size": 4, "effective_batch_size": 16, "num_train_epochs": 2,
                     "per_device_eval_batch_size": 4, "seed": 3, "max_grad_norm": 0.5, "mixed_precision": "no"},
        "optim": {"learning_rate": 1e-3, "warmup_steps": 1},
        "evaluation": {"metrics": ["accuracy", "f1"], "average": "binary", "positive_label": "spam"},
        "logging": {"progress_bar": False},
    }
    path = root / "run.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path, root


def _train_cmd(launch_flags: list[str], cfg: Path, out: Path, *overrides: str) -> list[str]:
    return _launcher(*launch_flags, str(REPO / "finetune" / "train.py"), "--config", str(cfg),
                     f"output.output_dir={out}", *overrides)


# a checkpoint in the middle of epoch 0 (of 4 updates, the last one ragged) for the resumes on another split
MID_EPOCH_CHECKPOINTS = ("output.checkpoint_every=3", "output.keep_last=null")


def _one_process_flags() -> list[str]:
    return ["--config_file", str(ACCEL_CONFIGS / "single_gpu.yaml")]


def _multi_gpu_flags() -> list[str]:
    """The multi-GPU config on a machine without a GPU: two processes over gloo."""
    return ["--config_file", str(ACCEL_CONFIGS / "multi_gpu.yaml"), "--num_processes", "2",
            "--main_process_port", str(free_port())]


@pytest.fixture(scope="module")
def cli_runs(cli_config):
    cfg, root = cli_config
    runs = {}
    # (b=16, k=1, P=1): the reference
    out = root / "one"
    proc = _run(_train_cmd(_one_process_flags(), cfg, out, "training.per_device_train_batch_size=16",
                           *MID_EPOCH_CHECKPOINTS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs["one"] = (out, proc.stderr)
    # (b=4, k=2, P=2), its splits tokenized afresh by two processes of the main one's
    out = root / "two"
    proc = _run(_train_cmd(_multi_gpu_flags(), cfg, out, *MID_EPOCH_CHECKPOINTS, "data.tokenize_processes=2",
                           f"data.cache_dir={root / 'two-cache'}"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs["two"] = (out, proc.stderr)
    # (b=8, k=1, P=2): two machines of one process each, over loopback
    out = root / "nodes"
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        cmd = _train_cmd(["--config_file", str(ACCEL_CONFIGS / "multi_node.yaml"), "--num_processes", "2",
                          "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1", "--main_process_port", port],
                         cfg, out, "training.per_device_train_batch_size=8")
        procs.append((_start(cmd), cmd))
    results = [_wait(p, cmd) for p, cmd in procs]
    for rank, proc in enumerate(results):
        assert proc.returncode == 0, f"machine {rank}:\n{proc.stderr[-4000:]}"
    runs["nodes"] = (out, results[0].stderr)
    return runs


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cli_start_line_gives_processes_backend_and_k(cli_runs):
    _, one = cli_runs["one"]
    assert "processes=1 " in one and " k=1 " in one and "effective_batch=16" in one
    _, two = cli_runs["two"]
    assert "no GPU found: running 2 processes as one DDP job on the CPU over gloo" in two
    assert "processes=2 backend=gloo" in two and " b=4 k=2 P=2 effective_batch=16" in two
    assert "Tokenizing" not in two and "examples/s" not in two  # logging.progress_bar: false: no datasets' bars
    _, nodes = cli_runs["nodes"]
    assert "processes=2 backend=gloo" in nodes and " b=8 k=1 P=2 effective_batch=16" in nodes


@pytest.mark.slow
def test_cli_a_launched_run_tokenizes_on_processes_of_its_own(cli_runs, cli_config):
    """The two-process run's main process tokenized both splits on two processes it started beside gloo's
    threads, and the other process read their shards: its model is the one-process run's (the test below)."""
    _, root = cli_config
    assert len(list((root / "two-cache").glob("*_0000[01]_of_00002.arrow"))) == 4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["two", "nodes"])
def test_cli_same_model_log_and_metrics_on_every_process_count(cli_runs, name):
    ref_out, _ = cli_runs["one"]
    out, _ = cli_runs[name]
    ref_w, w = _weights(ref_out), _weights(out)
    assert ref_w.keys() == w.keys()
    for key in ref_w:
        torch.testing.assert_close(w[key], ref_w[key], rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")

    ref_log, log = _log(ref_out), _log(out)
    train = [r for r in log if "train/loss" in r]
    ref_train = [r for r in ref_log if "train/loss" in r]
    # one record per update, written once (by the main process only), not once per process
    assert [r["step"] for r in train] == [r["step"] for r in ref_train] == list(range(1, len(ref_train) + 1))
    assert len(log) == len(ref_log)
    for a, b in zip(ref_train, train):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/lr"] == pytest.approx(a["train/lr"], rel=1e-12)
        assert (b["train/samples"], b["train/tokens"]) == (a["train/samples"], a["train/tokens"])
    assert train[-1]["train/lr"] > 0

    ref_metrics = json.loads((ref_out / "metrics.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["train"]["num_processes"] == 2 and ref_metrics["train"]["num_processes"] == 1
    # two processes on one machine plan with a share each of its memory; on two machines, each with all of its own
    assert metrics["memory_plan"]["processes_sharing_it"] == (2 if name == "two" else 1)
    assert ref_metrics["memory_plan"]["processes_sharing_it"] == 1
    assert metrics["train"]["effective_batch_size"] == ref_metrics["train"]["effective_batch_size"] == 16
    assert metrics["train"]["updates"] == ref_metrics["train"]["updates"]
    # the carved validation set is seen once, though its size is not a multiple of 2 processes x 4
    n_eval = N_ROWS - ref_metrics["train"]["samples"] // 2  # 2 epochs over the rest of the rows
    assert n_eval % (2 * 4) != 0
    assert metrics["eval"]["num_samples"] == ref_metrics["eval"]["num_samples"] == n_eval
    assert metrics["eval"]["accuracy"] == ref_metrics["eval"]["accuracy"]
    assert metrics["eval"]["f1"] == ref_metrics["eval"]["f1"]
    assert metrics["eval"]["loss"] == pytest.approx(ref_metrics["eval"]["loss"], rel=1e-5)


def test_cli_effective_batch_that_two_processes_cannot_split_is_one_line(cli_config, tmp_path):
    cfg, _ = cli_config
    proc = _run(_train_cmd(_two_process_flags(), cfg, tmp_path / "out", "training.effective_batch_size=12"))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # printed once (by the main process), naming B=12, b=4 and P=2
    assert len(errors) == 1, proc.stderr[-3000:]
    # the value came from the command line, and the line says so (not the config file it overrode)
    assert errors[0].startswith("error: command line: training.effective_batch_size: ")
    assert {"12", "4", "2"} <= set(re.findall(r"\d+", errors[0].split("effective_batch_size:")[1]))
    assert not (tmp_path / "out").exists()



@pytest.mark.slow
def test_cli_data_error_under_two_processes_is_one_line_without_a_traceback(cli_config, tmp_path):
    """The main process reads the data first while the other waits in a barrier: an error it met there left the
    other to break in the barrier with a traceback of its own (gloo's lost connection). It goes through the
    barrier first now; the other reads the same file and meets the same error, and the main one alone prints it."""
    cfg, _ = cli_config
    rows = make_texts(30, seed=2)
    data = write_tsv(tmp_path / "unlabelled.tsv", rows[:20] + [("", "a text without its label")] + rows[20:])
    proc = _run(_train_cmd(_two_process_flags(), cfg, tmp_path / "out", f"data.train_file={data}"))
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "unlabelled.tsv: 1 row without a label" in errors[0], proc.stderr[-3000:]
    assert "[rank1]" not in proc.stderr, proc.stderr[-3000:]  # no traceback of the waiting process
    assert not (tmp_path / "out").exists()

# --- resuming on another split of the effective batch -------------------------------------------


def _cut_back(finished: Path, copy: Path, step: int) -> Path:
    """A copy of a finished run's folder as it stood when ``checkpoint-<step>`` was its newest checkpoint."""
    final_outputs = {"model.safetensors", "metrics.json", "adapter"}
    shutil.copytree(finished, copy, ignore=lambda folder, names: final_outputs & set(names)
                    if folder == str(finished) else set())
    for checkpoint in (copy / "checkpoints").iterdir():
        if int(checkpoint.name.split("-")[1]) > step:
            shutil.rmtree(checkpoint)
    return copy


@pytest.mark.parametrize("written_by, flags, b, split, micro_batch", [
    ("two", _one_process_flags, 4, "(4, 2, 2) -> (4, 4, 1)", 12),  # a job requeued onto fewer processes
    ("one", _multi_gpu_flags, 8, "(16, 1, 1) -> (8, 1, 2)", 3),  # onto more (no random streams for process 1)
], ids=["two-to-one", "one-to-two"])
def test_a_checkpoint_resumes_on_another_split_of_the_effective_batch_to_the_same_model(
        cli_config, cli_runs, tmp_path, written_by, flags, b, split, micro_batch):
    """Stopped after update 3 of 8 (mid-epoch), resumed on another (b, k, P) with B = 16: the windows already
    trained are skipped at the new k, and the run ends with the model, log and metrics of every other split."""
    cfg, _ = cli_config
    reference, _ = cli_runs["one"]
    out = _cut_back(cli_runs[written_by][0], tmp_path / "resumed", step=3)
    proc = _run(_train_cmd(flags(), cfg, out, f"training.per_device_train_batch_size={b}", *MID_EPOCH_CHECKPOINTS))
    assert proc.returncode == 0, proc.stderr[-4000:]
    warning = f"resuming on another split of the effective batch of 16: (b, k, P) = {split}"
    assert proc.stderr.count(warning) == 1  # from the main process only
    assert f"checkpoint-3: update 3, epoch 0, micro-batch {micro_batch}" in proc.stderr  # 3 windows at the new k

    ref_w, w = _weights(reference), _weights(out)
    assert ref_w.keys() == w.keys()
    for key in ref_w:
        torch.testing.assert_close(w[key], ref_w[key], rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    train = [r for r in _log(out) if "train/loss" in r]
    ref_train = [r for r in _log(reference) if "train/loss" in r]
    assert [r["step"] for r in train] == [r["step"] for r in ref_train] == list(range(1, 9))
    for a, r in zip(ref_train, train):
        assert r["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert (r["train/samples"], r["train/tokens"], r["train/lr"]) == (a["train/samples"], a["train/tokens"],
                                                                           a["train/lr"])
    metrics, ref_metrics = (json.loads((o / "metrics.json").read_text()) for o in (out, reference))
    assert metrics["train"]["updates"] == 8 and metrics["eval"]["accuracy"] == ref_metrics["eval"]["accuracy"]


# --- LoRA and the best model on two processes -----------------------------------------------

LORA_TWO = ("model.lora_rank=4", "evaluation.eval_every=2", "evaluation.load_best_model_at_end=true",
            # the highest loss is the "best": an early checkpoint, so loading it changes the final weights
            "evaluation.metric_for_best_model=loss", "evaluation.greater_is_better=true", "output.keep_last=null",
            # both processes tokenize, and only the main one draws its bars
            "logging.progress_bar=true", "data.cache_tokenized=false")


def _two_processes(cfg: Path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    proc = _run(_train_cmd(_two_process_flags(), cfg, out, *overrides))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def lora_on_two_processes(cli_config):
    """A LoRA run on two processes that loads its best checkpoint at the end; then a copy of its folder cut
    back to the checkpoint after that best, resumed on two processes with the same command."""
    cfg, root = cli_config
    whole, resumed = root / "lora", root / "lora-resumed"
    test = write_tsv(root / "test.tsv", make_texts(20, seed=11))  # 5 batches of 4: 3 on one process, 2 on the other
    _two_processes(cfg, whole, *LORA_TWO, f"data.test_file={test}")
    best = json.loads((whole / "metrics.json").read_text())["best"]["step"]
    _cut_back(whole, resumed, best + 2)
    proc = _two_processes(cfg, resumed, *LORA_TWO, f"data.test_file={test}")
    return whole, resumed, best, proc.stderr


@pytest.mark.slow
def test_lora_on_two_processes_ends_with_its_best_checkpoint_merged(lora_on_two_processes):
    from finetune.lora import load_adapter_checkpoint

    whole, _, best, _ = lora_on_two_processes
    updates = json.loads((whole / "metrics.json").read_text())["train"]["updates"]
    assert best < updates  # else the check below could not tell the best model from the last one
    assert (whole / "adapter" / "adapter_model.safetensors").is_file()
    final = _weights(whole)
    expected = load_adapter_checkpoint(whole / "checkpoints" / f"checkpoint-{best}").state_dict()
    last = load_adapter_checkpoint(whole / "checkpoints" / f"checkpoint-{updates}").state_dict()
    assert final.keys() == expected.keys()
    for key in final:
        torch.testing.assert_close(final[key], expected[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert any(not torch.equal(final[key], last[key]) for key in final)
    # the test set's scores, two processes scoring a share each, are those finetune score gives the saved (merged,
    # best) model in one process
    from finetune.score import score_file

    scored = json.loads((whole / "metrics.json").read_text())["test"]
    assert scored["metrics"]["num_samples"] == 20
    assert score_file(whole, whole.parent / "test.tsv", count_seen=False).metrics == scored["metrics"]


@pytest.mark.slow
def test_lora_on_two_processes_resumes_exactly(lora_on_two_processes):
    whole, resumed, best, stderr = lora_on_two_processes
    assert best + 2 < json.loads((whole / "metrics.json").read_text())["train"]["updates"]  # updates left to train
    assert f"resumed from {resumed / 'checkpoints' / f'checkpoint-{best + 2}'}: update {best + 2}" in stderr
    # said once, at the start, though the test set's model joins the processes again at the end
    assert stderr.count("no GPU found: running 2 processes as one DDP job on the CPU over gloo") == 1
    assert stderr.count("Tokenizing train:   0%") == 1 and stderr.count("Tokenizing validation:   0%") == 1
    a, b = _weights(whole), _weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)

    def timeless(record):
        return {k: v for k, v in record.items() if "time" not in k and "per_s" not in k}

    assert [timeless(r) for r in _log(resumed)] == [timeless(r) for r in _log(whole)]


# --- the shipped Accelerate configs ----------------------------------------------------------

ACCEL_CONFIG_FILES = sorted(ACCEL_CONFIGS.glob("*.yaml"))


def _launch_args(path: Path):
    """What ``accelerate launch --config_file PATH`` makes of the file (its own parser and checks)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    args = launch_command_parser().parse_args(["--config_file", str(path), "finetune/train.py"])
    args, defaults, _ = _validate_launch_command(args)
    return args, defaults


def test_every_setup_has_a_config():
    assert {p.stem for p in ACCEL_CONFIG_FILES} >= {"single_gpu", "multi_gpu", "multi_node", "fsdp",
                                                     "deepspeed_zero2"}


@pytest.mark.parametrize("path", ACCEL_CONFIG_FILES, ids=lambda p: p.stem)
def test_accelerate_config_parses_and_names_its_command(path):
    from accelerate.commands.launch import launch_command_parser

    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert any(f"accelerate launch --config_file configs/accelerate/{path.name} " in line
               and "finetune/train.py" in line for line in header), "header must give the launch command"
    args, defaults = _launch_args(path)  # raises on an unknown top-level key or a bad combination
    # nested keys become launcher options (fsdp_config.x -> --fsdp_x): each must be one Accelerate knows
    options = {action.dest for action in launch_command_parser()._actions}
    for section in ("fsdp_config", "deepspeed_config", "dynamo_config"):
        for key in getattr(defaults, section) or {}:
            prefix = {"fsdp_config": "fsdp_", "dynamo_config": "dynamo_"}.get(section, "")
            assert (key if key.startswith(prefix) else prefix + key) in options, f"{section}.{key}"


def test_accelerate_configs_select_their_engine():
    kinds = {p.stem: _launch_args(p)[0] for p in ACCEL_CONFIG_FILES}
    assert kinds["single_gpu"].num_processes == 1 and not kinds["single_gpu"].multi_gpu
    assert kinds["multi_gpu"].multi_gpu and kinds["multi_gpu"].num_machines == 1
    assert kinds["multi_node"].multi_gpu and kinds["multi_node"].num_machines == 2
    assert kinds["multi_node"].rdzv_backend == "static"
    assert kinds["fsdp"].use_fsdp and kinds["deepspeed_zero2"].use_deepspeed


@pytest.mark.parametrize("engine, variable", [("FSDP", "ACCELERATE_USE_FSDP"),
                                              ("DeepSpeed", "ACCELERATE_USE_DEEPSPEED")])
def test_an_engine_asked_for_on_the_cpu_runs_as_ddp_or_is_refused_in_one_line(engine, variable, monkeypatch,
                                                                              fresh_accelerate_state, caplog):
    """Accelerate runs FSDP on GPUs only, and plain DDP on the CPU: said once. Its DeepSpeed state breaks on the
    CPU (with deepspeed installed, Accelerator() raises an AttributeError), so DeepSpeed is refused first."""
    from finetune.errors import LaunchError
    from finetune.launch import init_process_state

    monkeypatch.setenv(variable, "true")
    if engine == "DeepSpeed":
        with pytest.raises(LaunchError, match="^DeepSpeed needs GPUs; on the CPU launch without "
                                              "configs/accelerate/deepspeed_zero2.yaml"):
            init_process_state()
        return
    with caplog.at_level(logging.WARNING, logger="finetune"):
        assert init_process_state().device.type == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        "FSDP was requested but needs GPUs; Accelerate runs plain DDP on the CPU instead"]


def test_a_launch_whose_processes_did_not_all_join_is_refused_in_one_line(monkeypatch):
    """Accelerate's state counting fewer processes than the launcher started (a state made before the launch's
    variables were read, a machine of several that never joined) would train each process alone, on its own
    share of nothing: refused before anything is built, whichever way the count came out."""
    import accelerate

    from finetune.errors import LaunchError
    from finetune.launch import init_process_state

    class OneProcess:  # what Accelerate's state says however often it is built again
        num_processes, distributed_type, backend = 1, "NO", None
        device, is_main_process = torch.device("cpu"), True
        resets = 0

        def __init__(self, cpu: bool = False):
            pass

        @classmethod
        def _reset_state(cls):
            cls.resets += 1

    monkeypatch.setattr(accelerate, "PartialState", OneProcess)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match=r"^the launcher started 2 processes but Accelerate joined 1 \(NO\); "
                                          r"check accelerate launch's --num_processes and --num_machines"):
        init_process_state()
    assert OneProcess.resets == 1  # joined again over gloo once before giving up


def test_fsdp_config_builds_the_plugin_for_bert(monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env
    from transformers.models.bert import modeling_bert

    args, _ = _launch_args(ACCEL_CONFIGS / "fsdp.yaml")
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    # the block class to wrap exists in the BERT family the configs use
    assert all(hasattr(modeling_bert, name) for name in plugin.transformer_cls_names_to_wrap)


def test_deepspeed_config_builds_zero2_with_k_left_to_finetune(monkeypatch):
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args, defaults = _launch_args(ACCEL_CONFIGS / "deepspeed_zero2.yaml")
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as accelerate launch does
    _, env = prepare_deepspeed_cmd_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ds = DeepSpeedPlugin().deepspeed_config
    assert ds["zero_optimization"]["stage"] == 2
    # "auto": Accelerate fills it with the k finetune derives, instead of overriding it
    assert ds["gradient_accumulation_steps"] == "auto"
    assert ds["gradient_clipping"] == TrainingConfig().max_grad_norm
