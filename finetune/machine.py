"""What this machine has: the CPU cores and memory a process may use, its CPU's maker and feature flags, and the
NVIDIA GPUs its driver drives, whether torch can reach them or not.

Facts read from the system, with no decision in them: :mod:`finetune.launch` decides threads, workers and
precision from them, :mod:`finetune.memory` holds a run's memory plan to them, and :mod:`finetune.start_line`
says them.

A container's limits are its cgroup's: it sees its host's cores (``os.cpu_count``, its CPU affinity) and RAM
(``/proc/meminfo``), and the kernel holds it to a CPU quota and kills it at a memory limit. Both limits are read
here, by hand: the standard library and psutil read the machine, not a cgroup, and joblib's count of cores reads
only the hierarchy's root and no memory. The cgroup is the one ``/proc/self/cgroup`` names, or the hierarchy's
root where that path is not mounted (a container's own cgroup mounted as the root, Docker's and Kubernetes'
view); a limit on a cgroup above it holds too. cgroups v2 and v1 alike; elsewhere (macOS, Windows) no limit.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

CGROUPS = Path("/sys/fs/cgroup")
OWN_CGROUP = Path("/proc/self/cgroup")
# the NVIDIA driver's folder of one sub-folder for each GPU it drives, there whatever torch was built for
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
# cgroups v1 writes "no limit" as the largest page-aligned 64-bit number; anything past 2**62 bytes is none
_NO_V1_LIMIT = 1 << 62


def available_cores() -> int:
    """The CPU cores this process may use: those its affinity allows, no more than its cgroup's CPU quota
    (rounded up to whole cores).

    A container given 4 CPUs on a 64-core host still sees 64 cores; 64 threads there spend the quota early in
    each of the scheduler's periods and wait out the rest, stalled together.
    """
    quota = cpu_quota()
    cores = affinity_cores()
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def affinity_cores() -> int:
    """The CPU cores this process's affinity allows (all of the machine's where the platform has no affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_quota_note() -> str:
    """Why a CPU run has fewer cores than it sees, for the start line: ``"4 of 64 cores: the CPU quota"``, or
    ``""`` where it may use every core its affinity allows."""
    cores, seen = available_cores(), affinity_cores()
    return f"{cores} of {seen} cores: the CPU quota" if cores < seen else ""


def cpu_quota(root: Path = CGROUPS, own: Path = OWN_CGROUP) -> Optional[float]:
    """The CPUs this process's cgroup may use (its CPU quota over its period, the tightest of its and those
    above it: ``docker run --cpus``, a Kubernetes CPU limit, a systemd unit's ``CPUQuota``), or ``None`` where
    none is set or none can be read.

    Args:
        root: Where the cgroup hierarchies are mounted; for tests.
        own: The file that names this process's cgroups; for tests.
    """
    v2 = _is_v2(root)
    quotas = [quota for level in _cgroup_levels(root, own, "cpu") if (quota := _level_quota(level, v2)) is not None]
    return min(quotas, default=None)


def _level_quota(group: Path, v2: bool) -> Optional[float]:
    try:
        if v2:
            quota, period = (group / "cpu.max").read_text(encoding="ascii").split()
        else:
            quota = (group / "cpu.cfs_quota_us").read_text(encoding="ascii").strip()
            period = (group / "cpu.cfs_period_us").read_text(encoding="ascii")
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def ram_available() -> Optional[int]:
    """The machine's RAM available to a new allocation (Linux's ``MemAvailable``), or ``None`` where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_free() -> Optional[int]:
    """What this process may still take: the RAM available, or less where its cgroup's limit leaves less (a
    container sees its host's RAM, and the kernel kills it at its own limit); ``None`` where neither is known."""
    known = [room for room in (ram_available(), memory_limit_headroom()) if room is not None]
    return min(known, default=None)


def memory_limit_headroom(root: Path = CGROUPS, own: Path = OWN_CGROUP) -> Optional[int]:
    """The bytes this process's cgroup may still take before its memory limit (a container's ``--memory``, a
    Kubernetes memory limit, a systemd unit's ``MemoryMax``), the least of its and those above it, or ``None``
    where none is set or none can be read.

    What a cgroup holds counts less its inactive file pages, which the kernel reclaims before it kills a process
    (the working set, as Kubernetes counts it).

    Args:
        root: Where the cgroup hierarchies are mounted; for tests.
        own: The file that names this process's cgroups; for tests.
    """
    files = (("memory.max", "memory.current", "inactive_file") if _is_v2(root)
             else ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    headrooms = [room for level in _cgroup_levels(root, own, "memory")
                 if (room := _level_headroom(level, *files)) is not None]
    return min(headrooms, default=None)


def _level_headroom(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> Optional[int]:
    """One cgroup's limit less its working set; ``None`` where it has no limit, or no such files (a root)."""
    try:
        limit = (group / limit_file).read_text(encoding="ascii").strip()
        if limit == "max" or int(limit) >= _NO_V1_LIMIT:
            return None
        usage = int((group / usage_file).read_text(encoding="ascii"))
        stat = dict(line.split(" ", 1) for line in (group / "memory.stat").read_text(encoding="ascii").splitlines())
        inactive = int(stat.get(inactive_key, 0))
    except (OSError, ValueError):
        return None
    return max(0, int(limit) - max(0, usage - inactive))


def _is_v2(root: Path) -> bool:
    """Whether the cgroups are v2's one hierarchy (else v1's, one per controller, or none)."""
    return (root / "cgroup.controllers").exists()


def _own_path(lines: list[str], controller: Optional[str]) -> Optional[str]:
    """The process's cgroup among ``/proc/self/cgroup``'s lines: v2's (``0::/path``, ``controller`` None), or
    that of the v1 hierarchy that lists ``controller`` (``4:memory:/path``, ``3:cpu,cpuacct:/path``)."""
    for number, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if (number == "0" and not controllers) if controller is None else controller in controllers.split(","):
            return path
    return None


def _cgroup_levels(root: Path, own: Path, controller: str) -> list[Path]:
    """The directories of this process's cgroup and of those above it, up to the hierarchy's root, in the
    hierarchy that holds ``controller`` (v2's one, or v1's ``root/controller``); none where there is none."""
    try:
        lines = own.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    v2 = _is_v2(root)
    hierarchy = (root if v2 else root / controller).resolve()
    if not hierarchy.is_dir():
        return []
    path = _own_path(lines, None if v2 else controller)
    group = (hierarchy / path.lstrip("/")).resolve() if path else hierarchy
    if not group.is_dir() or not group.is_relative_to(hierarchy):
        group = hierarchy  # a container's own cgroup, mounted as the root
    return [level for level in (group, *group.parents) if level.is_relative_to(hierarchy)]


def _cpuinfo_field(name: str) -> str:
    """The first value of ``name`` in ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags from ``/proc/cpuinfo``: an x86 CPU's ``flags``, an ARM CPU's ``Features`` (empty
    where there is none, e.g. macOS)."""
    return set(_cpuinfo_field("flags").split()) | set(_cpuinfo_field("Features").split())


def cpu_vendor() -> str:
    """The CPU's maker as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``; empty where unknown)."""
    return _cpuinfo_field("vendor_id")


def nvidia_gpus(listed: Optional[Path] = None) -> int:
    """The GPUs the NVIDIA driver drives (0 where it is not loaded, or off Linux): what the machine has, where
    ``torch.cuda`` counts only those a CUDA build of torch can reach."""
    listed = NVIDIA_GPUS if listed is None else listed
    try:
        return sum(1 for entry in listed.iterdir() if entry.is_dir())
    except OSError:
        return 0
