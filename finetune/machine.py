"""What this machine has: the CPU cores and memory a process may use, and its CPU's maker and feature flags.

Facts read from the system, with no decision in them: :mod:`finetune.launch` decides threads, workers and
precision from them, :mod:`finetune.memory` holds a run's memory plan to them, and :mod:`finetune.start_line`
says them. A container's limits are a cgroup's: it sees the host's cores and memory, and may use less.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

CGROUPS = Path("/sys/fs/cgroup")
# cgroups v1 writes "no limit" as the largest page-aligned 64-bit number; anything past 2**62 bytes is none
_NO_V1_LIMIT = 1 << 62


def available_cores() -> int:
    """The CPU cores this process may use: those its affinity allows, no more than its container's CPU quota.

    A container given 4 CPUs on a 64-core host still sees 64 cores, in ``os.cpu_count`` and in its affinity; 64
    threads there spend the quota early in each of the scheduler's periods and wait out the rest, stalled
    together. joblib's count (what scikit-learn sizes its workers by) takes the quota into account, cgroups v1
    and v2, rounded up to whole cores, and ``LOKY_MAX_CPU_COUNT`` where one is set.
    """
    from joblib import cpu_count

    return max(1, cpu_count())


def affinity_cores() -> int:
    """The CPU cores this process's affinity allows (all of the machine's where the platform has no affinity)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_quota_note() -> str:
    """Why a CPU run has fewer cores than it sees, for the start line: ``"4 of 64 cores: the CPU quota"``, or
    ``""`` where it may use every core its affinity allows."""
    cores, seen = available_cores(), affinity_cores()
    if cores >= seen:
        return ""
    return f"{cores} of {seen} cores: {'LOKY_MAX_CPU_COUNT' if 'LOKY_MAX_CPU_COUNT' in os.environ else 'the CPU quota'}"


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


def memory_limit_headroom(root: Path = CGROUPS, own: Path = Path("/proc/self/cgroup")) -> Optional[int]:
    """The bytes this process's cgroup may still take before its memory limit (a container's ``--memory``, a
    Kubernetes memory limit, a systemd unit's ``MemoryMax``), or ``None`` where none is set or none can be read.

    What the cgroup holds counts less its inactive file pages, which the kernel reclaims before it kills a process
    (the working set, as Kubernetes counts it); a limit set on a cgroup above the process's counts too. The
    cgroup is the one ``own`` (``/proc/self/cgroup``) names, or the hierarchy's root where that path is not there:
    a container's own cgroup mounted as the root. Hand-written: the standard library and psutil read the
    machine's memory, not a cgroup's limit.

    Args:
        root: Where the cgroup hierarchies are mounted; for tests.
        own: The file that names this process's cgroups; for tests.
    """
    try:
        lines = own.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    if (root / "cgroup.controllers").exists():  # cgroups v2: one hierarchy
        hierarchy, controller = root, None
        files = ("memory.max", "memory.current", "inactive_file")
    else:  # cgroups v1: the memory controller's own hierarchy
        hierarchy, controller = root / "memory", "memory"
        files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    hierarchy = hierarchy.resolve()
    path = _cgroup_path(lines, controller)
    group = (hierarchy / path.lstrip("/")).resolve() if path else hierarchy
    if not group.is_dir() or not group.is_relative_to(hierarchy):
        group = hierarchy
    levels = [level for level in (group, *group.parents) if level.is_relative_to(hierarchy)]
    headrooms = [room for level in levels if (room := _cgroup_headroom(level, *files)) is not None]
    return min(headrooms, default=None)


def _cgroup_path(lines: list[str], controller: Optional[str]) -> Optional[str]:
    """The process's cgroup in ``/proc/self/cgroup``'s lines: v2's (``0::/path``, ``controller`` None), or the
    path of the v1 hierarchy that lists ``controller`` (``4:memory:/path``)."""
    for number, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if (number == "0" and not controllers) if controller is None else controller in controllers.split(","):
            return path
    return None


def _cgroup_headroom(group: Path, limit_file: str, usage_file: str, inactive_key: str) -> Optional[int]:
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
