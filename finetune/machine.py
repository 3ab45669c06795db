"""What this machine has: the CPU cores a process may use, and its CPU's maker and feature flags.

Facts read from the system, with no decision in them: :mod:`finetune.launch` decides threads, workers and
precision from them, and :mod:`finetune.start_line` says them.
"""

from __future__ import annotations

import os


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
