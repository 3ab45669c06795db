"""A CPU run's threads, DataLoader workers and tokenizing processes count the cores a process may use: those its
affinity allows, no more than its container's CPU quota. Tested in a real cgroup with a quota, seen from inside as
a container sees its own (``bench.cpu_quota.under_cpu_quota``); where this machine cannot make one (not root,
fewer than two cores), those tests are skipped and say why."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.cpu_quota import WARM_UPDATES, QuotaUnavailable, train_once, under_cpu_quota
from helpers import REPO, offline_env, write_sms_job

# what a process decides from its cores, printed as JSON
CHILD = """
import json, torch
from finetune.launch import choose_workers, configure_cpu_threads
from finetune.machine import affinity_cores, available_cores, cpu_quota_note
from finetune.tokens import ROWS_PER_PROCESS, tokenizing_processes
print(json.dumps({
    "available": available_cores(), "affinity": affinity_cores(), "note": cpu_quota_note(),
    "threads": configure_cpu_threads(torch.device("cpu"), 1), "torch_threads": torch.get_num_threads(),
    "gpu_workers": choose_workers("auto", torch.device("cuda"), 1),
    "tokenizing": tokenizing_processes("auto", 10 * ROWS_PER_PROCESS, start_method="fork"),
}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = offline_env(extra)
    for name in ("LOKY_MAX_CPU_COUNT", "LOCAL_WORLD_SIZE", "WORLD_SIZE"):
        env.pop(name, None)
    if "FINETUNE_CPU_THREADS" not in extra:
        env.pop("FINETUNE_CPU_THREADS", None)  # the suite pins one thread; these runs choose their own
    return env


def _decisions(prefix: list[str], **env: str) -> dict:
    done = subprocess.run([*prefix, sys.executable, "-c", CHILD], capture_output=True, text=True, env=_env(**env),
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def half_a_cpu():
    """The command prefix of a cgroup whose quota is half a CPU, on a machine of two cores or more."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a quota below the cores needs two cores or more")
    try:
        with under_cpu_quota(0.5) as prefix:
            yield prefix
    except QuotaUnavailable as exc:
        pytest.skip(str(exc))


def test_a_quota_of_half_a_cpu_gives_one_thread_where_the_process_sees_more_cores(half_a_cpu):
    free, quoted = _decisions([]), _decisions(half_a_cpu)
    cores = len(os.sched_getaffinity(0))
    assert free == {"available": cores, "affinity": cores, "note": "", "threads": cores, "torch_threads": cores,
                    "gpu_workers": min(4, cores - 1), "tokenizing": min(cores, 10)}
    # rounded up to one whole core: the threads, a GPU's DataLoader workers (one core left for training) and the
    # tokenizing processes all follow it
    assert quoted == {"available": 1, "affinity": cores, "note": f"1 of {cores} cores: the CPU quota",
                      "threads": 1, "torch_threads": 1, "gpu_workers": 0, "tokenizing": 1}


def test_a_pinned_thread_count_wins_over_the_quota(half_a_cpu):
    assert _decisions(half_a_cpu, FINETUNE_CPU_THREADS="2")["torch_threads"] == 2


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
def test_the_start_line_says_the_quota_took_the_cores(half_a_cpu, tmp_path):
    """A run under the quota, as ``bench.cpu_quota`` times it: its own threads, then two pinned."""
    cfg = write_sms_job(tmp_path, training={"per_device_train_batch_size": 8})
    cores = len(os.sched_getaffinity(0))
    own = train_once(half_a_cpu, tmp_path, WARM_UPDATES + 2, None, config=cfg)
    assert own["start"] == f"threads=1 (1 of {cores} cores: the CPU quota)"
    assert own["samples_per_s"] > 0
    pinned = train_once(half_a_cpu, tmp_path, WARM_UPDATES + 2, 2, config=cfg)
    assert pinned["start"] == f"threads=2 (1 of {cores} cores: the CPU quota)"


def test_the_cgroup_is_gone_after_the_block(tmp_path):
    try:
        with under_cpu_quota(1) as prefix:
            group = prefix[-2]  # unshare ... sh GROUP ROOT
            assert os.path.isdir(group)
    except QuotaUnavailable as exc:
        pytest.skip(str(exc))
    assert not os.path.exists(group)

