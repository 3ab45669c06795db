"""An archive's files read where they are packed: ``--data spam.zip``, or a path inside one,
``--data aclImdb_v1.tar.gz/aclImdb/train``.

Data sets are often handed out packed: a Kaggle download is a ``.zip``, many
papers' are a ``.tar.gz``. An archive (``.zip``, ``.tar``, or a tar compressed as
``.tar.gz``/``.tgz``, ``.tar.bz2``/``.tbz2``, ``.tar.xz``/``.txz``) is unpacked once into
``datasets``' cache (``HF_DATASETS_CACHE``), in a folder named by the SHA-256 of
its bytes: a rerun reads the copy, and an archive replaced by another at the same
path is unpacked anew; the processes of a launch take turns (a file lock), so one
unpacks and the others read its copy. :func:`finetune.resources.data_path` decides what an archive
reads as; errors name its files by their path in the archive (:func:`as_given`), not
by the copy's. A file the package makes from a data file (:func:`made_from`: a CSV file
whose escaped quotes are written as CSV's) is kept in the same cache and named the same way.

Unpacked with the standard library rather than ``datasets``' ``DownloadManager.extract``,
which names its copy by the archive's path (an archive replaced at the same path reads
the old copy) and takes a partly unpacked copy, left by a run that was stopped, for a
whole one. Here a copy is unpacked aside and renamed into place when it is whole.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tarfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable, Optional

from filelock import FileLock

from finetune.errors import DataError, root_message
from finetune.remote_files import is_url, url_file_name

logger = logging.getLogger("finetune.data")

# by the end of a file's name: a tar compressed whole is an archive too (`.tar.gz`), where `.gz` alone is one file
ARCHIVES = (".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
# what packers add beside the files (macOS's resource forks, Finder's and Explorer's folder settings)
PACKERS_ADDITIONS = ("__MACOSX", ".DS_Store", "Thumbs.db", "desktop.ini")
# each unpacked copy's folder, and the archive as its setting names it (a path or a URL), for the errors; each
# file made from another, and that one's path
_GIVEN: dict[str, str] = {}
# (path, size, modification time) -> the archive's digest: a run reads its data files more than once
_DIGESTS: dict[tuple[str, int, int], str] = {}


def is_archive(path: Path) -> bool:
    """Whether ``path``'s name is an archive's (``spam.zip``, ``reviews.tar.gz``); it need not be there."""
    return path.name.lower().endswith(ARCHIVES)


def archive_stem(name: str) -> str:
    """An archive's name without its extension: ``aclImdb_v1`` for ``aclImdb_v1.tar.gz``."""
    suffix = next((suffix for suffix in ARCHIVES if name.lower().endswith(suffix)), "")  # at most one ends it
    return name[: len(name) - len(suffix)]


def archive_on(path: Path) -> Optional[tuple[Path, PurePosixPath]]:
    """The archive file a path goes through, and the path inside it: ``(spam.zip, data/spam.csv)`` for
    ``spam.zip/data/spam.csv``; None where no folder above ``path`` is an archive file."""
    for above in path.parents:
        if is_archive(above) and above.is_file():
            return above, PurePosixPath(path.relative_to(above).as_posix())
    return None


def in_an_archive(spec: str) -> bool:
    """Whether a data setting names an archive (a file, or a URL's) or a path inside a local one: what is read is
    then in the unpacked copy."""
    if is_url(spec):
        return is_archive(Path(url_file_name(spec)))
    path = Path(spec)
    return (is_archive(path) and path.is_file()) or (not path.exists() and archive_on(path) is not None)


def unpacked(archive: Path, key: str, given: Optional[str] = None) -> Path:
    """The folder that holds ``archive``'s files, unpacked on the first call (``given``: the archive as its
    setting names it, :func:`as_given`'s name for the folder; the path where None).

    Raises:
        DataError: naming ``key`` and the archive where it cannot be read (damaged, encrypted, not the format
            its name says), or its files would not fit on the cache's disk.
    """
    import datasets.config  # its cache's place, which HF_DATASETS_CACHE and HF_HOME move

    given = given or str(archive)
    folder = Path(datasets.config.DOWNLOADED_DATASETS_PATH) / "unpacked" / _digest(archive)
    if not folder.is_dir():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{folder}.lock"):  # the processes of a launch: one unpacks, the others then find its copy
            if not folder.is_dir():
                _unpack_or_say_why(archive, folder, key, given)
    _GIVEN[str(folder)] = given
    return folder


def _unpack_or_say_why(archive: Path, folder: Path, key: str, given: str) -> None:
    try:
        _unpack(archive, folder)
    except _Refused as exc:
        raise DataError(f"{key}: {given}: cannot unpack: {exc.args[0]}", hint=exc.args[1]) from None
    except (OSError, EOFError, RuntimeError, ValueError, zipfile.BadZipFile, tarfile.TarError) as exc:
        # a cut or damaged file, a member whose compression Python lacks
        raise DataError(f"{key}: {given}: cannot unpack: {root_message(exc)}",
                        hint=_unpack_hint(archive, exc)) from None
    logger.info("%s: unpacked into %s", given, folder)


def made_from(source: Path, kind: str, name: str, make: Callable[[Path], None]) -> Path:
    """A file ``make`` writes from ``source`` (given the path to write), made once into ``datasets``' cache as an
    archive is unpacked, in a folder of ``kind`` named by ``source``'s digest: a rerun reads it, the processes of a
    launch take turns, and a copy cut short is never taken for a whole one. Errors and log lines name it as
    ``source``, as :func:`as_given` names an archive's files."""
    import datasets.config

    folder = Path(datasets.config.DOWNLOADED_DATASETS_PATH) / kind / _digest(source)
    made = folder / name
    if not made.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{folder}.lock"):
            if not made.is_file():
                aside = folder / f".{name}.partial"
                make(aside)
                os.replace(aside, made)
    _GIVEN[str(made)] = str(source)
    return made


def as_given(text: Optional[str]) -> Optional[str]:
    """``text`` with each unpacked copy's folder named as the archive it came from: ``spam.zip/spam.csv``; each
    file made from another (:func:`made_from`) named as that one, the newest first, since it may be made from an
    archive's file."""
    for folder, given in reversed(_GIVEN.items()):
        text = text and text.replace(folder, given)
    return text


class _NamedAsGiven(logging.Filter):
    """Names an unpacked copy's files by their path in the archive in the data's log lines too (a class folder's
    warning, a CSV read as semicolon-separated), as :func:`as_given` names them in its errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _GIVEN:
            message = record.getMessage()
            named = as_given(message)
            if named != message:
                record.msg, record.args = named, ()
        return True


logger.addFilter(_NamedAsGiven())


def holds(folder: Path) -> list[Path]:
    """A folder's entries, sorted, without what packers add beside the files."""
    return sorted(entry for entry in folder.iterdir() if entry.name not in PACKERS_ADDITIONS)


def _digest(archive: Path) -> str:
    stat = archive.stat()
    key = (str(archive.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(archive, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        _DIGESTS[key] = digest.hexdigest()[:32]
    return _DIGESTS[key]


def _unpack(archive: Path, folder: Path) -> None:
    """Unpack ``archive`` into ``folder``: aside, then renamed into place whole, so that a run stopped halfway
    leaves no copy to be taken for whole; where another copy took the place first (a file system whose locks
    do not hold across machines), that one stays."""
    aside = folder.with_name(f".{folder.name}.{os.getpid()}")
    shutil.rmtree(aside, ignore_errors=True)  # this process's own, left by a run that was stopped
    aside.mkdir(parents=True)
    try:
        if archive.name.lower().endswith(".zip"):
            with zipfile.ZipFile(archive) as packed:
                _refuse_encrypted(packed, archive)
                _check_room(sum(member.file_size for member in packed.infolist()), aside)
                packed.extractall(aside)  # a member named outside the folder (`../x`, `/x`) is put inside it
        else:
            with tarfile.open(archive) as packed:  # its compression read from its first bytes
                members = [member for member in packed.getmembers() if _plain_and_inside(member)]
                _check_room(sum(member.size for member in members), aside)
                packed.extractall(aside, members=members, **_TAR_FILTER)
        try:
            os.replace(aside, folder)
        except OSError:
            if not folder.is_dir():  # else another process's whole copy took the place first: that one is read
                raise
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def _plain_and_inside(member: tarfile.TarInfo) -> bool:
    """A file or folder whose path stays inside the archive's folder: links and devices are left out, as
    tarfile's ``data`` filter refuses them too (it is on where the Python has it)."""
    parts = PurePosixPath(member.name).parts
    return (member.isfile() or member.isdir()) and not PurePosixPath(member.name).is_absolute() and ".." not in parts


_TAR_FILTER = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


class _Refused(Exception):
    """What stops an archive's unpacking before it starts: the reason, and what to do."""


def _refuse_encrypted(packed: zipfile.ZipFile, archive: Path) -> None:
    encrypted = [member.filename for member in packed.infolist() if member.flag_bits & 0x1]  # the zip format's bit
    more = f" (and {len(encrypted) - 1} more)" if len(encrypted) > 1 else ""
    if encrypted:
        raise _Refused(f"{encrypted[0]} is encrypted{more}",
                       f"unpack it with its password (unzip {archive}) and pass the file it holds")


def _check_room(size: int, folder: Path) -> None:
    free = shutil.disk_usage(folder).free
    if size > free:
        raise _Refused(f"its files take {size / 1e9:.1f}GB and the cache's disk has {free / 1e9:.1f}GB free",
                       "HF_DATASETS_CACHE=<a folder on a disk with room> moves the cache")


def _unpack_hint(archive: Path, exc: BaseException) -> Optional[str]:
    if isinstance(exc, (zipfile.BadZipFile, tarfile.TarError, EOFError)):
        test = "unzip -t" if archive.name.lower().endswith(".zip") else "tar -tf"
        return f"it may be cut short, or not an archive: {test} {archive} tests it"
    return None
