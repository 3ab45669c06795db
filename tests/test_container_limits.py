"""A container's limits, which it does not see in the host's cores and memory: a CPU run's threads, DataLoader
workers and tokenizing processes count the cores a process may use (its affinity, no more than its CPU quota), and
the memory plan holds a run to the memory its cgroup may still take. Tested in real cgroups with a quota or a
limit, seen from inside as a container sees its own (``bench.cgroups.in_a_container``), and on cgroup files
written here for the layouts this machine does not have; where it cannot make a cgroup (not root, fewer than two
cores for a quota below them), those tests are skipped and say why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.cgroups import CgroupsUnavailable, in_a_container
from bench.cpu_quota import WARM_UPDATES, tokenize_once, train_once
from helpers import REPO, offline_env, write_sms_job

# what a process decides from its cores, printed as JSON
CHILD = """
import json, os, torch
from tokenizers import Tokenizer, models, pre_tokenizers
from finetune.launch import choose_workers, configure_cpu_threads
from finetune.machine import affinity_cores, available_cores, cpu_quota_note
from finetune.tokens import ROWS_PER_PROCESS, tokenizing_processes

def tokenizer_pool():
    # the threads a fast tokenizer's first batch starts: its thread pool (rayon), made at that batch
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    before = len(os.listdir("/proc/self/task"))
    tokenizer.encode_batch(["a b a"] * 256)
    return len(os.listdir("/proc/self/task")) - before

threads = configure_cpu_threads(torch.device("cpu"), 1)
print(json.dumps({
    "available": available_cores(), "affinity": affinity_cores(), "note": cpu_quota_note(),
    "threads": threads, "torch_threads": torch.get_num_threads(),
    "gpu_workers": choose_workers("auto", torch.device("cuda"), 1),
    "tokenizing": tokenizing_processes("auto", 10 * ROWS_PER_PROCESS, start_method="fork"),
    "tokenizer_pool": tokenizer_pool(),
}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = offline_env(extra)
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        env.pop(name, None)
    if "FINETUNE_CPU_THREADS" not in extra:
        env.pop("FINETUNE_CPU_THREADS", None)  # the suite pins one thread; these runs choose their own
    if "RAYON_NUM_THREADS" not in extra:
        env.pop("RAYON_NUM_THREADS", None)
    return env


def _decisions(prefix: list[str], **env: str) -> dict:
    env = {"TOKENIZERS_PARALLELISM": "true", **env}  # the suite turns the tokenizers' threads off
    done = subprocess.run([*prefix, sys.executable, "-c", CHILD], capture_output=True, text=True, env=_env(**env),
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def _write(directory, **files: str):
    """Files of a cgroup, written here: ``cpu__max="..."`` is ``cpu.max``."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("__", ".")).write_text(text)
    return directory


@pytest.fixture(scope="module")
def one_cpu():
    """The command prefix of a cgroup whose quota is one CPU, on a machine of two cores or more."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a quota below the cores needs two cores or more")
    try:
        with in_a_container(cpus=1) as prefix:
            yield prefix
    except CgroupsUnavailable as exc:
        pytest.skip(str(exc))


def test_a_quota_of_one_cpu_gives_one_thread_where_the_process_sees_more_cores(one_cpu):
    free, quoted = _decisions([]), _decisions(one_cpu)
    cores = len(os.sched_getaffinity(0))
    assert free == {"available": cores, "affinity": cores, "note": "", "threads": cores, "torch_threads": cores,
                    "gpu_workers": min(4, cores - 1), "tokenizing": min(cores, 10), "tokenizer_pool": cores}
    # the threads, a GPU's DataLoader workers (one core left for training), the tokenizing processes and the
    # tokenizers' own thread pool (which starts one per core seen, quota or not) all follow the quota
    assert quoted == {"available": 1, "affinity": cores, "note": f"1 of {cores} cores: the CPU quota",
                      "threads": 1, "torch_threads": 1, "gpu_workers": 0, "tokenizing": 1, "tokenizer_pool": 1}


def test_a_quota_is_read_where_the_process_sees_the_whole_hierarchy():
    """A systemd unit's view: no mount of its own, its cgroup a path in the host's hierarchy (``/proc/self/cgroup``)
    below the root, which has no quota."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a quota below the cores needs two cores or more")
    try:
        with in_a_container(cpus=0.5, namespaced=False) as prefix:
            quoted = _decisions(prefix)
    except CgroupsUnavailable as exc:
        pytest.skip(str(exc))
    assert quoted["available"] == 1 and quoted["threads"] == 1  # half a CPU, rounded up to a whole core


def _cpu_quota(root, own_lines: str):
    from finetune.machine import cpu_quota

    own = root.parent / "self-cgroup"
    own.write_text(own_lines)
    return cpu_quota(root=root, own=own)


def test_cpu_quotas_in_each_layout(tmp_path):
    v2 = _write(tmp_path / "v2", cgroup__controllers="cpu memory", cpu__max="max 100000\n")
    assert _cpu_quota(v2, "0::/\n") is None
    _write(v2 / "system.slice" / "train.service", cpu__max="250000 100000\n")
    assert _cpu_quota(v2, "0::/system.slice/train.service\n") == 2.5
    _write(v2 / "system.slice", cpu__max="150000 100000\n")  # the tightest of the unit's and the slice's
    assert _cpu_quota(v2, "0::/system.slice/train.service\n") == 1.5
    (v2 / "cpu.max").write_text("400000 100000\n")  # a container's own, mounted as the root
    assert _cpu_quota(v2, "0::/kubepods/pod1/abc\n") == 4
    v1 = tmp_path / "v1"
    _write(v1 / "cpu,cpuacct", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    (v1 / "cpu").symlink_to(v1 / "cpu,cpuacct")  # as systemd mounts it
    assert _cpu_quota(v1, "3:cpu,cpuacct:/\n") is None
    _write(v1 / "cpu,cpuacct" / "docker" / "abc", cpu__cfs_quota_us="50000", cpu__cfs_period_us="100000")
    assert _cpu_quota(v1, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n") == 0.5
    (v1 / "cpu,cpuacct" / "docker" / "abc" / "cpu.cfs_period_us").write_text("0")
    assert _cpu_quota(v1, "3:cpu,cpuacct:/docker/abc\n") is None  # what cannot be read is no quota
    assert _cpu_quota(tmp_path / "none", "0::/\n") is None  # no cgroups at all (macOS)


def test_a_pinned_thread_count_wins_over_the_quota(one_cpu):
    assert _decisions(one_cpu, FINETUNE_CPU_THREADS="2")["torch_threads"] == 2
    assert _decisions(one_cpu, RAYON_NUM_THREADS="2")["tokenizer_pool"] == 2  # the tokenizers' pool, set by hand


def test_a_gpu_runs_tokenizers_are_held_to_the_quota_too(monkeypatch):
    """A GPU run tokenizes on the CPU: its tokenizers' pool follows the quota as a CPU run's does, where the
    quota leaves fewer cores than the process sees and the pool's size is not set already."""
    import finetune.launch
    from finetune.launch import configure_cpu_threads

    monkeypatch.setenv("RAYON_NUM_THREADS", "")
    monkeypatch.delenv("RAYON_NUM_THREADS")  # and back to what it was after the test
    monkeypatch.setattr(finetune.launch, "affinity_cores", lambda: 64)
    monkeypatch.setattr(finetune.launch, "available_cores", lambda: 64)
    assert configure_cpu_threads(torch.device("cuda"), 1) is None
    assert "RAYON_NUM_THREADS" not in os.environ  # no quota: rayon's own count is right
    monkeypatch.setattr(finetune.launch, "available_cores", lambda: 4)
    configure_cpu_threads(torch.device("cuda"), 1)
    assert os.environ["RAYON_NUM_THREADS"] == "4"
    monkeypatch.setenv("RAYON_NUM_THREADS", "12")
    configure_cpu_threads(torch.device("cuda"), 1)
    assert os.environ["RAYON_NUM_THREADS"] == "12"  # the user's own setting stands


@pytest.mark.parametrize("pinned", ["0", "-2", "1.5", "two"])
def test_a_pinned_thread_count_must_be_a_whole_number_of_one_or_more(monkeypatch, pinned):
    from finetune.errors import LaunchError
    from finetune.launch import configure_cpu_threads

    monkeypatch.setenv("FINETUNE_CPU_THREADS", pinned)
    before = torch.get_num_threads()
    said = f"^FINETUNE_CPU_THREADS: expected a whole number of 1 or more, got '{pinned}'$"
    with pytest.raises(LaunchError, match=said):
        configure_cpu_threads(torch.device("cpu"), 1)
    assert torch.get_num_threads() == before


@pytest.mark.slow
def test_the_start_line_says_the_quota_took_the_cores(one_cpu, tmp_path):
    """A run under the quota, as ``bench.cpu_quota`` times it."""
    cfg = write_sms_job(tmp_path, training={"per_device_train_batch_size": 8})
    cores = len(os.sched_getaffinity(0))
    own = train_once(one_cpu, tmp_path, WARM_UPDATES + 2, None, config=cfg)
    assert own["start"] == f"threads=1 (1 of {cores} cores: the CPU quota)"
    assert own["samples_per_s"] > 0


@pytest.mark.slow
def test_the_tokenizing_benchmark_sizes_the_pool_as_each_way_says(one_cpu, tmp_path):
    """``bench.cpu_quota --tokenizing``: the package's way is the pool it chose under the quota, a pinned way its own."""
    cfg = write_sms_job(tmp_path)
    own, pinned = tokenize_once(one_cpu, 500, None, config=cfg), tokenize_once(one_cpu, 500, 3, config=cfg)
    assert (own["pool"], pinned["pool"]) == ("1", "3")
    assert own["texts_per_s"] > 0 and pinned["texts_per_s"] > 0


# --------------------------------------------------------------------------- memory


def _headroom(root, own_lines: str):
    from finetune.machine import memory_limit_headroom

    own = root.parent / "self-cgroup"
    own.write_text(own_lines)
    return memory_limit_headroom(root=root, own=own)


def test_a_v2_containers_headroom_is_its_limit_less_its_working_set(tmp_path):
    root = _write(tmp_path / "cgroup", cgroup__controllers="cpu memory", memory__max="2000000000\n",
                  memory__current="900000000\n", memory__stat="anon 600000000\ninactive_file 200000000\n")
    # a container's own cgroup mounted as the root: its path is "/", or one this mount does not have
    assert _headroom(root, "0::/\n") == 2_000_000_000 - (900_000_000 - 200_000_000)
    assert _headroom(root, "0::/kubepods/pod1/abc\n") == 1_300_000_000
    (root / "memory.max").write_text("max\n")
    assert _headroom(root, "0::/\n") is None


def test_a_limit_above_the_processs_cgroup_counts_and_the_tightest_wins(tmp_path):
    root = _write(tmp_path / "cgroup", cgroup__controllers="memory")  # the root has no memory.max
    _write(root / "user.slice", memory__max="3000000000", memory__current="2500000000", memory__stat="")
    _write(root / "user.slice" / "job.scope", memory__max="max", memory__current="100", memory__stat="")
    assert _headroom(root, "0::/user.slice/job.scope\n") == 500_000_000
    _write(root / "user.slice" / "job.scope", memory__max="200000000")
    assert _headroom(root, "0::/user.slice/job.scope\n") == 200_000_000 - 100
    # never below nothing: a cgroup over its limit (its pages swapped, or about to be reclaimed) has no room
    _write(root / "user.slice", memory__current="3100000000")
    assert _headroom(root, "0::/user.slice/job.scope\n") == 0


def test_a_v1_memory_hierarchy_is_read_where_the_process_lists_the_controller(tmp_path):
    root = tmp_path / "cgroup"
    memory = _write(root / "memory", memory__limit_in_bytes="9223372036854771712", memory__usage_in_bytes="5",
                    memory__stat="")
    _write(memory / "docker" / "abc", memory__limit_in_bytes="1073741824", memory__usage_in_bytes="600000000",
           memory__stat="cache 300000000\ntotal_inactive_file 100000000\n")
    own = "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n"
    assert _headroom(root, own) == 1_073_741_824 - 500_000_000
    assert _headroom(root, "4:memory:/\n") is None  # the root's "no limit"
    # what cannot be read is no limit: a number missing, a word for one, no /proc/self/cgroup
    (memory / "docker" / "abc" / "memory.usage_in_bytes").unlink()
    assert _headroom(root, own) is None
    (memory / "docker" / "abc" / "memory.usage_in_bytes").write_text("lots")
    assert _headroom(root, own) is None
    from finetune.machine import memory_limit_headroom

    assert memory_limit_headroom(root=root, own=tmp_path / "missing") is None


MEMORY_CHILD = """
import json, torch
from finetune.memory import available_memory, memory_limit_binds
print(json.dumps({"available": available_memory(torch.device("cpu")), "binds": memory_limit_binds()}))
"""
GB = 10**9


@pytest.mark.parametrize("namespaced", [True, False], ids=["as-a-container-sees-it", "as-a-service-sees-it"])
def test_the_memory_a_run_counts_on_is_its_cgroups_limit_not_the_hosts(namespaced):
    host = _available(MEMORY_CHILD, [])
    if host["available"] < 4 * GB:
        pytest.skip("a limit below the machine's memory needs more than 4 GB of it")
    try:
        with in_a_container(memory=2 * GB, namespaced=namespaced) as prefix:
            limited = _available(MEMORY_CHILD, prefix)
    except CgroupsUnavailable as exc:
        pytest.skip(str(exc))
    # the limit less what the child (Python and torch) already holds
    assert 2 * GB - 1.5 * GB < limited["available"] < 2 * GB < host["available"]
    assert limited["binds"] and not host["binds"]  # which the start line says: "of 1.9GB available under ..."


def _available(child: str, prefix: list[str]) -> dict:
    done = subprocess.run([*prefix, sys.executable, "-c", child], capture_output=True, text=True, env=_env(),
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_run_that_would_be_killed_at_the_containers_limit_stops_in_one_line_first(tmp_path):
    """A 100M-weight BERT (1.8 GB to train with AdamW) under a limit of 1.5 GB, on a host of more: the plan is
    held to the limit and refused, naming what would fit, where without the check the kernel kills the run; the
    automatic micro-batch finds nothing that fits, and says so, rather than try and be killed."""
    from transformers import BertConfig, BertForSequenceClassification

    cfg = write_sms_job(tmp_path, training={"per_device_train_batch_size": 8, "max_steps": 1})
    model = tmp_path / "tiny-bert"  # its tokenizer, with encoder blocks of bert-large's width
    config = BertConfig.from_pretrained(model)
    config.update({"hidden_size": 1024, "num_hidden_layers": 8, "intermediate_size": 4096, "num_attention_heads": 16})
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(model)
    command = [sys.executable, "-m", "finetune.cli", "train", "--config", str(cfg)]
    try:
        with in_a_container(memory=int(1.5 * GB)) as prefix:
            refused, killed, automatic = (
                subprocess.run([*prefix, *command, "--output", str(tmp_path / out), *settings], capture_output=True,
                               text=True, env=_env(), cwd=REPO, timeout=300)
                for out, settings in [("refused", []), ("killed", ["training.memory_check=false"]),
                                      ("auto", ["training.per_device_train_batch_size=auto",
                                                "training.effective_batch_size=8"])])
    except CgroupsUnavailable as exc:
        pytest.skip(str(exc))
    assert refused.returncode == 2, refused.stderr[-3000:]
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("error: memory: the run needs about 1.7")
    assert " of 1.5GB available under the memory limit; any of these alone would fit: " in error
    assert "Traceback" not in refused.stderr
    assert killed.returncode == -9, killed.stderr[-3000:]  # the limit is real: unchecked, the kernel kills it
    # the automatic micro-batch tries only what the plan says fits: here nothing, said in one line, no trial killed
    assert automatic.returncode == 2, automatic.stderr[-3000:]
    error = automatic.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "Traceback" not in automatic.stderr
    assert ("training.per_device_train_batch_size: auto found no micro-batch that fits: even b=1 does not fit in the "
            "memory available by the memory plan (on at least one process), with gradient checkpointing too; ") in error


@pytest.mark.slow
def test_where_memory_is_short_the_heap_is_released_so_that_the_plan_is_the_peak(tmp_path):
    """LoRA with checkpointing at 512 tokens, a MiniLM-sized encoder: glibc's kept heap holds the freed space
    between the activations, about twice what the plan counts here. Under a limit between the two, the default
    (``training.cpu_heap: auto``) keeps the heap only until short, as the plan is more than a quarter of the memory
    available: it releases it before the first micro-batch, whose kept heap could outgrow what is free, and
    trains; the kept heap, which the plan passes just the same, is killed by the kernel."""
    import random

    from transformers import BertConfig, BertForSequenceClassification

    from helpers import WORDS, write_tsv

    rng = random.Random(0)
    cfg = write_sms_job(tmp_path, model={"lora_rank": 8}, data={"max_length": 512},
                        training={"per_device_train_batch_size": 8, "effective_batch_size": 16, "max_steps": 1,
                                  "gradient_checkpointing": True},
                        output={"save_checkpoints": False})
    write_tsv(tmp_path / "sms.tsv", [(label, " ".join(rng.choice(WORDS) for _ in range(600)))
                                     for label in ("spam", "ham") * 30])
    model = tmp_path / "tiny-bert"  # its tokenizer, with MiniLM-L6's encoder blocks and 512 positions
    config = BertConfig.from_pretrained(model)
    config.update({"hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1536, "num_attention_heads": 12,
                   "max_position_embeddings": 512})
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(model)
    command = [sys.executable, "-m", "finetune.cli", "train", "--config", str(cfg)]
    try:
        # measured outside a cgroup: a peak resident size of 1.2 GB released, 2.3 GB kept
        with in_a_container(memory=int(1.75 * GB)) as prefix:
            automatic, kept = (
                subprocess.run([*prefix, *command, "--output", str(tmp_path / heap), f"training.cpu_heap={heap}"],
                               capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
                for heap in ("auto", "keep"))
    except CgroupsUnavailable as exc:
        pytest.skip(str(exc))
    assert automatic.returncode == 0, automatic.stderr[-3000:]
    start = next(line for line in automatic.stderr.splitlines() if " start: " in line)
    assert "available under the memory limit" in start
    assert "heap=keep_until_short (auto: 4 x the memory plan is more than the memory available)" in start
    assert "cpu heap: released from a micro-batch of 8 rows x 512 tokens on: 4 x its plan" in automatic.stderr
    assert (tmp_path / "auto" / "model.safetensors").is_file()
    assert kept.returncode == -9, kept.stderr[-3000:]  # the same plan passed, and the kernel killed it
    assert "heap=" not in next(line for line in kept.stderr.splitlines() if " start: " in line)
