"""A program run as in a container: a new cgroup with a CPU quota or a memory limit, seen from inside.

``in_a_container(cpus=1, memory=2 * 2**30)`` yields a command prefix; a program run behind it is in a cgroup of
its own with those limits and, by default, sees that cgroup as a container sees its own (Docker's and Kubernetes'
view): the cgroup's directory mounted, in a mount namespace of the program's own, over the hierarchy's root
(cgroups v2's ``/sys/fs/cgroup``, v1's ``/sys/fs/cgroup/cpu`` and ``/sys/fs/cgroup/memory``). With
``namespaced=False`` it sees the hierarchy as a systemd service does, its own cgroup a path in it
(``/proc/self/cgroup``). The cgroups are removed when the block ends. It needs root and util-linux's ``unshare``.

The CPU-quota benchmark (``bench.cpu_quota``) and the tests of what the package reads of a cgroup use it.
"""
from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

PERIOD_US = 100_000  # the scheduler's period a CPU quota is a share of (the kernel's default)
ROOT = Path("/sys/fs/cgroup")
_GROUPS = itertools.count()  # a name for each cgroup this process makes


class CgroupsUnavailable(RuntimeError):
    """This machine cannot make a cgroup with limits and a mount namespace to see it from (not root, no
    ``unshare``, a read-only or absent cgroup file system, a controller missing)."""


@contextmanager
def in_a_container(*, cpus: Optional[float] = None, memory: Optional[int] = None,
                   namespaced: bool = True) -> Iterator[list[str]]:
    """A command prefix that runs a program in a new cgroup limited to ``cpus`` CPUs and ``memory`` bytes.

    Raises:
        CgroupsUnavailable: where the cgroup or the namespace cannot be made.
    """
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        raise CgroupsUnavailable("making a cgroup and a mount namespace needs root and util-linux's unshare")
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        raise CgroupsUnavailable("unshare cannot make a mount namespace here (a container without CAP_SYS_ADMIN)")
    limits = _limit_files(cpus, memory)
    name = f"finetune-{os.getpid()}-{next(_GROUPS)}"
    groups: list[tuple[Path, Path]] = []  # (the cgroup, its hierarchy's root)
    try:
        for root, files in limits.items():
            group = root / name
            group.mkdir()
            groups.append((group, root))
            for file, value in files.items():
                (group / file).write_text(value)
    except OSError as exc:
        _remove(groups)
        raise CgroupsUnavailable(f"cannot make a cgroup with those limits: {exc}") from None
    script = "".join(f'echo $$ > "{group}/cgroup.procs" && ' for group, _ in groups)
    if namespaced:
        script += "".join(f'mount --bind "{group}" "{root}" && ' for group, root in groups)
    try:
        yield ["unshare", "--mount", "--propagation", "private", "sh", "-c", script + 'exec "$@"', "sh"]
    finally:
        _remove(groups)


def _limit_files(cpus: Optional[float], memory: Optional[int]) -> dict[Path, dict[str, str]]:
    """For each hierarchy the limits are set in (one under cgroups v2, one per controller under v1), the files
    that set them and their values."""
    quota = None if cpus is None else max(1000, round(cpus * PERIOD_US))
    if (ROOT / "cgroup.controllers").exists():  # cgroups v2 alone
        files = {}
        if quota is not None:
            files["cpu.max"] = f"{quota} {PERIOD_US}"
        if memory is not None:
            files["memory.max"] = str(memory)
        _enable_controllers([name.split(".")[0] for name in files])
        return {ROOT: files}
    limits = {}
    if quota is not None:
        limits[_v1_hierarchy("cpu")] = {"cpu.cfs_quota_us": str(quota)}
    if memory is not None:
        limits[_v1_hierarchy("memory")] = {"memory.limit_in_bytes": str(memory)}
    return limits


def _enable_controllers(controllers: list[str]) -> None:
    try:
        enabled = (ROOT / "cgroup.subtree_control").read_text().split()
        for controller in controllers:
            if controller not in enabled:
                (ROOT / "cgroup.subtree_control").write_text(f"+{controller}")
    except OSError as exc:
        raise CgroupsUnavailable(f"cannot hand the {', '.join(controllers)} controllers to a new cgroup: {exc}") \
            from None


def _v1_hierarchy(controller: str) -> Path:
    hierarchy = ROOT / controller
    if not (hierarchy / "cgroup.procs").exists():
        raise CgroupsUnavailable(f"no cgroup {controller} controller under {ROOT} (neither v2 nor v1's {controller}/)")
    return hierarchy.resolve()


def _remove(groups: list[tuple[Path, Path]]) -> None:
    for group, _ in groups:
        try:
            group.rmdir()  # a cgroup is removed empty, its files and all; its processes have exited
        except OSError:
            pass
