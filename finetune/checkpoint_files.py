"""A checkpoint's folder on disk: its names, ``trainer_state.json`` and manifest; finding, verifying,
publishing and pruning checkpoints.

Nothing here knows what a run is: these are the files and the rules that make a
folder named ``checkpoint-<update>`` complete or passed over. A checkpoint is
written into ``.tmp-checkpoint-<update>``, its manifest last, flushed to disk, and
renamed into place (:func:`publish`), so that a folder under the final name is
always whole. :mod:`finetune.checkpoint` writes what goes in it;
:mod:`finetune.resuming` decides which one a run continues.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

from finetune.errors import ConfigError
from finetune.outputs import CHECKPOINTS_DIR

CHECKPOINT_PREFIX = "checkpoint-"
TMP_PREFIX = ".tmp-" + CHECKPOINT_PREFIX
OLD_PREFIX = ".old-" + CHECKPOINT_PREFIX
STATE_FILE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
MANIFEST_FILE = "manifest.json"
# 2: with manifest.json. Checkpoints of format 1 (no manifest) still resume, unverified.
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)

_NAME = re.compile(rf"^(\.old-)?{CHECKPOINT_PREFIX}(\d+)$")  # OLD_PREFIX or the final name


# --------------------------------------------------------------------------- finding checkpoints

def checkpoints_root(output_dir: str | os.PathLike) -> Path:
    """``<output_dir>/checkpoints``."""
    return Path(output_dir) / CHECKPOINTS_DIR


def read_state(path: str | os.PathLike) -> dict[str, Any]:
    """The ``trainer_state.json`` of a checkpoint directory.

    Raises:
        ConfigError: if the directory is not a complete checkpoint of this format.
    """
    path = Path(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"output.resume_from: {path} is not a complete checkpoint (no {STATE_FILE})") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"output.resume_from: {path / STATE_FILE} cannot be read ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        raise ConfigError(f"output.resume_from: {path / STATE_FILE} is not a finetune checkpoint (format "
                          f"{meta.get('format') if isinstance(meta, dict) else '?'}, expected {FORMAT_VERSION})")
    return meta


def list_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``<output_dir>/checkpoints``, oldest (fewest updates) first.

    Temporary directories of a save that was cut short, and directories
    without a readable ``trainer_state.json``, are not checkpoints. A
    ``.old-checkpoint-<update>`` (the previous copy while the same update is
    saved again) counts only if a kill left it without its replacement.
    """
    root = checkpoints_root(output_dir)
    found: dict[int, Path] = {}
    if root.is_dir():
        for child in sorted(root.iterdir(), key=lambda p: p.name.startswith(".")):  # final names first
            match = _NAME.match(child.name)
            if match and child.is_dir() and int(match.group(2)) not in found:
                try:
                    read_state(child)
                except ConfigError:
                    continue
                found[int(match.group(2))] = child
    return [found[step] for step in sorted(found)]


def resolve_resume(output_dir: str | os.PathLike, resume_from: Optional[str]) -> Optional[Path]:
    """The checkpoint ``output.resume_from`` names at first sight (no file verified), or ``None`` for a fresh run.

    A start-up check, before any work: :func:`~finetune.resuming.choose_checkpoint` then verifies the
    files and, for ``latest`` and ``auto``, passes over damaged checkpoints.

    Args:
        output_dir: ``output.output_dir``.
        resume_from: ``auto`` (the newest complete checkpoint under
            ``<output_dir>/checkpoints``, or ``None`` when there is none),
            ``latest`` (the same, but there must be one) or a checkpoint directory.

    Raises:
        ConfigError: if ``latest`` finds nothing complete, or the directory is no checkpoint.
    """
    if not resume_from:
        return None
    if resume_from in ("auto", "latest"):
        found = list_checkpoints(output_dir)
        if not found and resume_from == "latest":
            raise ConfigError(
                f"output.resume_from: latest, but {checkpoints_root(output_dir)} holds no complete checkpoint "
                f"(output.resume_from=auto starts afresh when there is none)"
            )
        return found[-1] if found else None
    path = Path(resume_from).expanduser()
    if not path.is_dir():
        raise ConfigError(f"output.resume_from: {path} is not a directory (give a checkpoint directory, latest "
                          f"or auto)")
    read_state(path)
    return path


def unreadable_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """Directories named like checkpoints whose ``trainer_state.json`` is missing or cannot be read."""
    root = checkpoints_root(output_dir)
    if not root.is_dir():
        return []
    bad = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and _NAME.match(child.name) and not child.name.startswith("."):
            try:
                read_state(child)
            except ConfigError:
                bad.append(child)
    return bad


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """``manifest.json``: the size and SHA-256 of every file in the checkpoint directory (written last)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    entries = {p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (directory / MANIFEST_FILE).write_text(json.dumps({"files": entries}, indent=1) + "\n", encoding="utf-8")


def verify_checkpoint(path: Path) -> Optional[str]:
    """What is wrong with a checkpoint's files, or ``None`` when they are the ones saved.

    A checkpoint of format 1 has no manifest: it is taken as it is.
    """
    try:
        meta = read_state(path)
    except ConfigError as exc:
        return exc.message.split(": ", 1)[-1]
    if meta.get("format", 1) < 2:
        return None
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST_FILE} is missing or unreadable"
    for name, entry in manifest.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, {entry['size']} were saved"
        if _sha256(file) != entry["sha256"]:
            return f"{name} does not hold the bytes that were saved (SHA-256 differs)"
    return None


# --------------------------------------------------------------------------- writing one

def space_problem(root: Path) -> Optional[str]:
    """Not enough free space for another checkpoint the size of the last one, said in words; else ``None``."""
    previous = list_checkpoints(root.parent)
    if not previous:
        return None
    needed = folder_bytes(previous[-1])
    free = shutil.disk_usage(root).free
    if free >= needed:
        return None
    return (f"no space left for a checkpoint: {free / 1e6:.0f} MB free, the last one took {needed / 1e6:.0f} MB")


def folder_bytes(path: Path) -> int:
    """The bytes of the files under ``path``: a checkpoint's, or a run's whole folder."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def fresh_dir(tmp: Path) -> None:
    """An empty ``.tmp-checkpoint-<update>``: a save cut short by a kill left one, which holds nothing kept."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)


def publish(tmp: Path, final: Path, root: Path) -> None:
    """The manifest (last), flush to disk, and the rename that makes the checkpoint exist."""
    write_manifest(tmp)
    _fsync_tree(tmp)
    if final.exists():
        # the same update saved again (its epoch's evaluation ran since): swap, never leaving
        # a half-built directory under the final name
        old = root / f"{OLD_PREFIX}{final.name.removeprefix(CHECKPOINT_PREFIX)}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)


def _fsync_tree(path: Path) -> None:
    """Flush the files of ``path`` to disk, so that the rename publishes complete data even after a crash."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory; the rename is still atomic
    finally:
        os.close(fd)


def prune(root: Path, keep_last: Optional[int], keep: set) -> None:
    """Delete checkpoints beyond ``keep_last`` (oldest first, never one in ``keep``) and leftovers of
    interrupted saves. The ones in ``keep`` count towards ``keep_last``."""
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith((TMP_PREFIX, OLD_PREFIX)):
            shutil.rmtree(child, ignore_errors=True)  # a save cut short by a kill
    if keep_last is None:
        return
    complete = list_checkpoints(root.parent)
    kept = [p for p in complete if p in keep]
    others = [p for p in complete if p not in keep]
    for path in others[: max(0, len(others) - max(0, keep_last - len(kept)))]:
        shutil.rmtree(path, ignore_errors=True)
